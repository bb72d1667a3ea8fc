"""The defaults a user meets, one home each: the node's port, the timeouts, the Metal share of RAM.

Command-line options, library arguments and dataclass fields take these;
nothing else writes the numbers. Limits the wire itself defines (the
handshake deadline, keepalive bounds, the idle timeout) are C's
(``ggml_backend/proto.h``); ``IDLE_TIMEOUT_S`` is the command line's copy of
``TB_IDLE_MS``, pinned to it by ``tests/test_cluster.py``.
"""

from __future__ import annotations

PORT = 50052                 # `tbrpc node`'s TCP port
HTTP_PORT = 8000             # `tbrpc launch`'s OpenAI-compatible API
STALL_TIMEOUT_S = 10.0       # a peer silent mid-message this long is dropped (node) or failed (head)
IDLE_TIMEOUT_S = 600.0       # a client holding nothing may stay silent this long (TB_IDLE_MS)
START_TIMEOUT_S = 60.0       # launch and tbrpc.Llama: every node answers within this
STOP_TIMEOUT_S = 10.0        # launch: a node still running this long after it was asked to stop is killed
ASK_TIMEOUT_S = 3.0          # plan: each node has this long to say its memory
CHECK_TIMEOUT_S = 5.0        # doctor and status: each node (each network check) has this long to answer
CLIENT_STALL_TIMEOUT_S = 30.0 # launch: an HTTP client that takes none of its answer this long counts as gone
FACTS_TIMEOUT_S = 30.0       # doctor and launch: a machine's facts (`python -m tbrpc.facts`, over ssh) within this

# llama-cpp-python's n_batch and n_ubatch. A larger --ubatch raises the batch
# with it (plan.default_batch): llama.cpp caps n_ubatch at n_batch.
BATCH = 512

# launch and tbrpc.Llama give llama.cpp the TBRPC devices only, on any head (a
# Mac's Metal too stays unused): the head runs no layers. `tbrpc plan` plans
# that unless told otherwise.
HEAD_DEVICE = "none"

# macOS's default GPU wired-memory cap on machines with more than 64 GB of
# RAM (recommendedMaxWorkingSetSize); smaller Macs get about two thirds.
METAL_FRACTION = 0.75
