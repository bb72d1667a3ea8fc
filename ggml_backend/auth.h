// auth.h - proving knowledge of a shared cluster secret, without sending it.
//
// A self-contained SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), fresh
// nonces from the operating system, and a comparison whose time does not
// depend on where two MACs differ. The handshake that uses them (HELLO, then
// AUTH; and the greeting on node-to-node links) is in docs/protocol.md.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TB_SHA256_LEN     32
#define TB_NONCE_LEN      32
#define TB_MAC_LEN        32
#define TB_SECRET_MAX     64          // bytes of a cluster secret (tbrpc secret new writes 32)

struct tb_sha256 {
    uint32_t state[8];
    uint64_t bytes;                   // message length so far
    uint8_t  block[64];
    size_t   used;                    // bytes waiting in block
};

void tb_sha256_init(struct tb_sha256 * s);
void tb_sha256_update(struct tb_sha256 * s, const void * data, size_t len);
void tb_sha256_final(struct tb_sha256 * s, uint8_t out[TB_SHA256_LEN]);
// Which compression this process uses: "portable", or the CPU's SHA
// instructions ("x86 SHA-NI", "ARMv8 SHA2"); TBRPC_SHA256_PORTABLE=1 forces
// the portable one.
const char * tb_sha256_impl(void);

// HMAC-SHA256 over the concatenation of up to four parts (NULL parts are skipped).
void tb_hmac_sha256(const uint8_t * key, size_t key_len,
                    const void * p1, size_t l1, const void * p2, size_t l2,
                    const void * p3, size_t l3, const void * p4, size_t l4,
                    uint8_t out[TB_MAC_LEN]);

// 1 when a and b are equal; the time taken does not depend on their contents.
int tb_equal_ct(const uint8_t * a, const uint8_t * b, size_t len);

// Fill out with len random bytes from the operating system. 0, or -1.
int tb_random(void * out, size_t len);

// The MAC one side of a handshake sends: HMAC(secret, role || nonce_a || nonce_b || extra).
// `role` says who proves and where ("head", "node", "peer acceptor", ...), so
// a MAC one side sent can never be replayed as the other side's.
void tb_auth_mac(const uint8_t * secret, size_t secret_len, const char * role,
                 const uint8_t nonce_a[TB_NONCE_LEN], const uint8_t nonce_b[TB_NONCE_LEN],
                 const void * extra, size_t extra_len, uint8_t out[TB_MAC_LEN]);

#ifdef __cplusplus
}
#endif
