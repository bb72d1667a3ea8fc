"""cffi build of tbrpc's C library (ggml_backend/) into ``tbrpc._native``.

It compiles against the ggml headers that llama-cpp-python installs
(``site-packages/include``) and links to the very ggml libraries that its
``libllama`` loads, by SONAME, so the devices we register land in the registry
llama.cpp actually reads. No llama.cpp source tree and no second llama.cpp
build are needed.

A plain ``pip install`` builds in an isolated environment whose own
llama-cpp-python (a build requirement, pinned like the run-time dependency)
provides the headers; that environment is gone afterwards. So the library
finds ggml at run time relative to itself: ``site-packages/tbrpc/_native*.so``
looks in ``site-packages/llama_cpp/lib``. An editable or ``--no-build-isolation``
build against the running interpreter's own llama-cpp-python also records that
directory, since the extension then lives in the source tree. At run time
``tbrpc.native`` imports llama_cpp first, and the loader hands us the ggml
libllama already loaded.
"""

from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
C_DIR = ROOT / "ggml_backend"
TRANSPORT_SOURCES = ["transport.c", "transport/tcp.c", "transport/ring.c", "transport/shm.c",
                     "transport/verbs_load.c", "transport/rdma.c", "transport/upgrade.c",
                     "transport/rdma_report.c", "transport/qp_budget.c"]
# shm_open lives in librt, dlopen (of the verbs library) in libdl, on C libraries older than glibc 2.34
SYSTEM_LIBS = ["-pthread"] + (["-lrt", "-ldl"] if sys.platform.startswith("linux") else [])
# what needs no ggml: the transports and the shared-secret proofs (C tests build them alone)
PLAIN_SOURCES = [*TRANSPORT_SOURCES, "auth.c", "trace.c"]
C_SOURCES = ["proto.c", "op_rules.c", "client.c", "client_node.c", "split_rules.c", "node.c", "node_session.c",
             "node_graphs.c", "node_files.c", "node_links.c", "model_file.c", *PLAIN_SOURCES]

PROTO_CDEF = """
struct tb_abi { uint32_t proto_version; uint32_t backend_api_version; uint32_t ggml_op_count;
                uint32_t ggml_type_count; uint64_t type_table_hash; ...; };
struct tb_hello { struct tb_abi abi; uint64_t mem_free; uint64_t mem_total; uint64_t alignment;
                  uint64_t max_size; uint32_t device_type; uint32_t keepalive_ms; uint64_t caps; uint8_t file_nonce[16];
                  char device_name[...]; char device_description[...]; char node_name[...]; char ggml_build[...];
                  uint8_t nonce[32]; uint8_t node_id[16]; ...; };
struct tb_status { uint64_t buffers; uint64_t bytes_allocated; uint64_t clients; uint64_t graphs_computed;
                   uint64_t bytes_received; uint64_t bytes_from_files; uint64_t allreduces; uint64_t allreduce_ns;
                   uint64_t mem_free; uint64_t mem_total; char device_name[...]; ...; };
struct tb_header { uint32_t magic; uint16_t cmd; uint16_t flags; uint64_t id; uint64_t len; };
struct tb_reply_status { int32_t status; uint32_t peer; };
struct tb_range { uint64_t handle, offset, size; };
struct tb_alloc_req { uint64_t size; };
struct tb_alloc_reply { uint64_t handle, base, size; };
struct tb_graph_header { uint32_t n_tensors; uint32_t n_nodes; uint32_t slot; uint32_t reserved; };
struct tb_wire_tensor { uint64_t buffer; uint64_t offset; int64_t ne[4]; uint64_t nb[4]; uint32_t type;
                        uint32_t op; int32_t op_params[16]; int32_t flags; int32_t view_src; uint64_t view_offs;
                        int32_t src[10]; char name[64]; int32_t use_count; int32_t reserved; };
#define TB_MAGIC ...
#define TB_PROTO_VERSION ...
#define TB_MAX_PAYLOAD ...
#define TB_CAP_SUPPORTS_OP_IS_CPU ...
#define TB_KEPT_GRAPHS ...
#define TB_CAP_AUTH ...
#define TB_CAP_MODEL_FILES ...
#define TB_HANDSHAKE_MS ...
enum tb_reply_code { TB_STATUS_OK, TB_STATUS_ERROR, TB_STATUS_VERSION, TB_STATUS_AUTH, TB_STATUS_FULL, ... };
enum tb_cmd { TB_CMD_HELLO, TB_CMD_GET_MEMORY, TB_CMD_ALLOC_BUFFER, TB_CMD_FREE_BUFFER, TB_CMD_BUFFER_CLEAR,
              TB_CMD_SET_TENSOR, TB_CMD_GET_TENSOR, TB_CMD_MEMSET_TENSOR, TB_CMD_COPY_TENSOR,
              TB_CMD_GRAPH_COMPUTE, TB_CMD_GRAPH_RECOMPUTE, TB_CMD_SUPPORTS_OP, TB_CMD_SYNC, TB_CMD_STATUS,
              TB_CMD_KEEPALIVE, TB_CMD_GET_ALLOC_SIZE, TB_CMD_OPEN_FILE, TB_CMD_LOAD_FROM_FILE,
              TB_CMD_PEER_LISTEN, TB_CMD_PEER_CONNECT, TB_CMD_PEER_ACCEPT, TB_CMD_PEER_SEND, TB_CMD_PEER_RECV,
              TB_CMD_TRANSPORT_OFFER, TB_CMD_TRANSPORT_SWITCH, TB_CMD_ALLREDUCE, TB_CMD_SET_TENSOR_2D,
              TB_CMD_LOAD_FROM_FILE_2D, TB_CMD_AUTH, TB_CMD_COUNT_, ... };
struct tb_auth_req { uint8_t mac[32]; };
struct tb_auth_reply { uint8_t mac[32]; struct tb_hello hello; };
struct tb_peer_listen_reply { uint64_t token, port; };
struct tb_peer_connect { char host[256]; uint64_t port, token, caps, flags; };
struct tb_peer_connect_reply { uint64_t peer_id; char transport[96]; uint32_t why_kind; uint32_t reserved; };
struct tb_allreduce { uint64_t handle, offset, size; uint32_t type; uint32_t flags; uint32_t n, self;
                      uint64_t peer_out[16]; uint64_t peer_in[16]; };
#define TB_MAX_ALLREDUCE_NODES ...
#define TB_ALLREDUCE_COMPUTED ...
#define TB_ALLREDUCE_RING ...
enum tb_why { TB_WHY_NONE, TB_WHY_ASKED, TB_WHY_PEER_NO_RDMA, TB_WHY_NO_RDMA_HERE, TB_WHY_QP_BUDGET, TB_WHY_NO_SHM,
              TB_WHY_SHM_FAILED, TB_WHY_RDMA_FAILED, TB_WHY_PEER_OLD, TB_WHY_NO_LINK, ... };
enum tb_trace_what { TB_TRACE_FLUSH = 1, TB_TRACE_REPLY, TB_TRACE_REQUEST, TB_TRACE_DONE, TB_TRACE_GRAPH_START,
                     TB_TRACE_GRAPH_END, TB_TRACE_PEER_DATA, ... };
struct tb_trace_event { int64_t t_ns; uint16_t what; uint16_t cmd; uint32_t reserved; };
struct tb_peer_greeting { char magic[8]; uint8_t nonce[32]; uint8_t mac[32]; };
struct tb_peer_answer { uint8_t nonce[32]; uint8_t mac[32]; char name[64]; };
void tb_peer_key(const uint8_t * secret, size_t secret_len, uint64_t token, uint8_t out[32]);
void tb_auth_mac(const uint8_t * secret, size_t secret_len, const char * role, const uint8_t nonce_a[32],
                 const uint8_t nonce_b[32], const void * extra, size_t extra_len, uint8_t out[32]);
struct tb_open_file { uint64_t size; uint8_t content_hash[32]; uint8_t proof[16]; char name[256]; };
struct tb_file_range { uint64_t handle, offset, size, file_id, file_offset; };
void tb_abi_fill(struct tb_abi * abi);
bool tb_cmd_posted(uint16_t cmd);
enum tb_len_rule { TB_LEN_EXACT, TB_LEN_AT_LEAST, TB_LEN_ANY };
struct tb_command { const char * name; bool posted; uint8_t request; uint32_t request_len; uint8_t reply;
                    uint32_t reply_len; };
const struct tb_command * tb_command(uint16_t cmd);
const char * tb_cmd_name(uint16_t cmd);
void tb_ggml_build(char * out, size_t len);

struct tb_file_identity { uint64_t size; uint8_t fingerprint[16]; };
int tb_file_proof_path(const char * path, uint64_t size, const uint8_t nonce[16], uint8_t out[16], char * err, size_t err_len);
int tb_file_hash_path(const char * path, const char * cache_dir, uint8_t out[32], int * computed, char * err, size_t err_len);
int tb_file_hash_fd(int fd, uint64_t size, int n_threads, const int * stop, uint8_t out[32], char * err, size_t err_len);
void tb_hash_cache_dir(char * out, size_t len);
"""


def _declarations(header: str) -> str:
    """The C declarations of one of our plain headers, for cffi: without
    comments, preprocessor lines and the C++ guard. node.h and tbrpc.h are
    read this way, so the binding cannot drift from them; proto.h's structs,
    which need ggml's headers, are declared above as far as Python uses them."""
    text = (C_DIR / header).read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


CDEF = PROTO_CDEF + _declarations("node.h") + _declarations("tbrpc.h") + _declarations("transport/rdma_report.h")


def llama_cpp_paths() -> tuple[Path, Path, bool]:
    """(include dir, lib dir, whether it is the running interpreter's own) of llama-cpp-python."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    candidates = [purelib] + [Path(p) for p in sys.path if p.endswith("site-packages")]
    for base in candidates:
        include, lib = base / "include", base / "llama_cpp" / "lib"
        if (include / "ggml-backend.h").is_file() and any((lib / name).exists() for name in GGML_LIBS):
            return include, lib, base == purelib
    raise RuntimeError(
        "tbrpc builds against the ggml of llama-cpp-python, and none was found on sys.path; "
        "a plain `pip install` provides it as a build requirement"
    )


GGML_LIBS = ("libggml.so.0", "libggml.0.dylib")
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-Wno-format-truncation"]


def ggml_link(lib: Path) -> list[str]:
    if sys.platform == "darwin":
        return [f"-L{lib}", "-lggml", "-lggml-base"]
    # by SONAME: the loader then reuses the copies libllama already loaded
    return [f"-L{lib}", "-l:libggml.so.0", "-l:libggml-base.so.0"]


def build_program(source: Path, exe: Path, with_ggml: bool = True, defines: tuple[str, ...] = (),
                  compiler: tuple[str, ...] = ("cc",)) -> Path:
    """Compile a C test or benchmark program with tbrpc's C sources: all of
    them against llama-cpp-python's ggml, or (with_ggml=False) those that need
    no ggml (transports, auth). Warnings are errors. `defines` ("NAME" or "NAME=VALUE") go to every
    source: build variants for tests (the deliberately broken RDMA wires, the
    op rules' test hooks TB_OP_RULES_TESTING). `compiler` is the command and
    its own options: a cross compiler for another CPU, say."""
    import subprocess

    cmd = [*compiler, "-std=gnu11", "-O2", *WARNINGS, "-Werror", *[f"-D{d}" for d in defines], f"-I{C_DIR}", str(source)]
    if with_ggml:
        include, lib, _ = llama_cpp_paths()
        cmd += [f"-I{include}", *[str(C_DIR / s) for s in C_SOURCES], *ggml_link(lib), f"-Wl,-rpath,{lib}"]
    else:
        cmd += [str(C_DIR / s) for s in PLAIN_SOURCES]
    subprocess.run([*cmd, *SYSTEM_LIBS, "-o", str(exe)], check=True)
    return exe


def build_verbs_sim(out: Path) -> Path:
    """The stand-in verbs provider (tests/c/verbs_sim.c) as a shared library,
    for TBRPC_VERBS_LIB. Needs the verbs headers (Debian: libibverbs-dev)."""
    import subprocess

    source = ROOT / "tests" / "c" / "verbs_sim.c"
    subprocess.run(["cc", "-std=gnu11", "-O2", *WARNINGS, "-Werror", "-fPIC", "-shared", "-fvisibility=hidden",
                    str(source), "-pthread", "-o", str(out)], check=True)
    return out


def have_verbs_headers() -> bool:
    """Whether this machine's C compiler finds <infiniband/verbs.h>."""
    import subprocess

    probe = subprocess.run(["cc", "-E", "-x", "c", "-"], input="#include <infiniband/verbs.h>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


def make_ffi() -> FFI:
    include, lib, own = llama_cpp_paths()
    ffi = FFI()
    ffi.cdef(CDEF)
    beside = "@loader_path/../llama_cpp/lib" if sys.platform == "darwin" else "$ORIGIN/../llama_cpp/lib"
    rpaths = [beside] + ([str(lib)] if own else [])
    link = ggml_link(lib) + [f"-Wl,-rpath,{path}" for path in rpaths]
    ffi.set_source(
        "tbrpc._native",
        '#include "tbrpc.h"\n#include "transport/rdma_report.h"\n#include "trace.h"',
        # relative to the project root: setuptools refuses absolute source paths
        sources=[f"ggml_backend/{s}" for s in C_SOURCES],
        include_dirs=[str(C_DIR), str(include)],
        extra_compile_args=["-std=gnu11", "-O2", *WARNINGS, "-Werror=implicit-function-declaration", "-pthread"],
        extra_link_args=link + SYSTEM_LIBS,
    )
    return ffi


ffibuilder = make_ffi() if __name__ != "__main__" else None

if __name__ == "__main__":
    make_ffi().compile(tmpdir=str(ROOT), verbose=True)
