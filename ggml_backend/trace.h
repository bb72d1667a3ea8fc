// trace.h - when a session's requests, graphs and peer data happened, to
// find where a decoded token's time goes across processes.
//
// Off unless the environment names a directory (TBRPC_TRACE=DIR): then a
// head's connection to a node, and a node's session with a head, each write
// their own record of events to a file of their own, timestamped by the
// host's monotonic clock (the clock every process on a host shares, so a
// head's and its nodes' records line up):
//   DIR/<role>-<pid>-<ns>.trace   role "head" or "node", ns the clock at opening
// The file is a text line naming the role and who (the node's endpoint, or
// the node's name), then fixed records (struct tb_trace_event, host byte
// order), written through stdio's buffer: a process that exits normally
// without closing its connections still leaves them all.
// benchmarks/trace_hops.py reads them and lays a token's critical path out
// hop by hop. A record costs a clock read and a copy into the buffer; a
// trace holds at most TB_TRACE_MAX events (the first ones).
#pragma once

#include <stdint.h>

enum tb_trace_what {
    TB_TRACE_FLUSH = 1,     // head: requests up to `cmd` were handed to the transport (the node can see them);
                            // only a flush that sent bytes
    TB_TRACE_REPLY,         // head: the reply header to `cmd` arrived
    TB_TRACE_REQUEST,       // node: a request header `cmd` was read
    TB_TRACE_DONE,          // node: request `cmd` was carried out (a called one is answered right after)
    TB_TRACE_GRAPH_START,   // node: a graph starts computing
    TB_TRACE_GRAPH_END,     // node: and ends
    TB_TRACE_PEER_DATA,     // node: a peer's activations (PEER_RECV) or partial (ALLREDUCE) are in
};

struct tb_trace_event {
    int64_t  t_ns;          // tb_now_ns()
    uint16_t what;          // enum tb_trace_what
    uint16_t cmd;           // enum tb_cmd, where it applies
    uint32_t reserved;
};

#define TB_TRACE_MAX (1u << 20)

struct tb_trace;
// A trace for one connection, or NULL when TBRPC_TRACE is not set (or its file cannot be made).
struct tb_trace * tb_trace_open(const char * role, const char * who);
void tb_trace_mark(struct tb_trace * t, uint16_t what, uint16_t cmd);   // nothing when t is NULL
// Close the file and free t (NULL: nothing). A trace that cannot be written is lost, silently: it is a measurement aid.
void tb_trace_close(struct tb_trace * t);
