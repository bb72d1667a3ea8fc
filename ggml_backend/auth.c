// auth.c - SHA-256, HMAC-SHA256, nonces and a constant-time comparison.
// Checked against FIPS 180-4's and RFC 4231's test vectors (tests/c/auth_tests.c).
#include "auth.h"

#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress_portable(uint32_t st[8], const uint8_t b[64]) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t) b[4 * i] << 24 | (uint32_t) b[4 * i + 1] << 16 | (uint32_t) b[4 * i + 2] << 8 | b[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = st[0], bb = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = bb; bb = a; a = t1 + t2;
    }
    st[0] += a; st[1] += bb; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

// The CPU's own SHA-256 instructions, where there are any: compress_hw() and
// cpu_has_sha_instructions(), one pair per architecture. compress_blocks()
// below is the one place that picks between them and the portable code.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TB_SHA256_HW "x86 SHA-NI"
#include <cpuid.h>
#include <immintrin.h>

// The same compression with the x86 SHA extensions (SHA256RNDS2, MSG1,
// MSG2): about ten times the portable speed, which is what makes hashing a
// whole model file affordable. The state is kept as the instructions want
// it, ABEF and CDGH; four schedule words at a time.
__attribute__((target("sha,sse4.1,ssse3")))
static void compress_hw(uint32_t st[8], const uint8_t * p, size_t n_blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bll, 0x0405060700010203ll);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *) &st[0]), 0xB1);   // C D A B
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *) &st[4]), 0x1B);  // E F G H
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                           // A B E F
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                                // C D G H
    for (; n_blocks > 0; n_blocks--, p += 64) {
        const __m128i save0 = s0, save1 = s1;
        __m128i m[4];
        for (int g = 0; g < 16; g++) {
            if (g < 4) {
                m[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *) (p + 16 * g)), bswap);
            } else {   // W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], four at a time
                __m128i w = _mm_sha256msg1_epu32(m[g & 3], m[(g + 1) & 3]);
                w = _mm_add_epi32(w, _mm_alignr_epi8(m[(g + 3) & 3], m[(g + 2) & 3], 4));
                m[g & 3] = _mm_sha256msg2_epu32(w, m[(g + 3) & 3]);
            }
            __m128i k = _mm_add_epi32(m[g & 3], _mm_loadu_si128((const __m128i *) &K[4 * g]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, k);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
        }
        s0 = _mm_add_epi32(s0, save0);
        s1 = _mm_add_epi32(s1, save1);
    }
    t = _mm_shuffle_epi32(s0, 0x1B);                                       // F E B A
    s1 = _mm_shuffle_epi32(s1, 0xB1);                                      // D C H G
    _mm_storeu_si128((__m128i *) &st[0], _mm_blend_epi16(t, s1, 0xF0));    // D C B A
    _mm_storeu_si128((__m128i *) &st[4], _mm_alignr_epi8(s1, t, 8));       // H G F E
}

// SHA (CPUID leaf 7, EBX bit 29), SSSE3 and SSE4.1 (leaf 1, ECX bits 9 and 19).
static bool cpu_has_sha_instructions(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b >> 29 & 1)) return false;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 19 & 1) && (c >> 9 & 1);
}
#elif defined(__aarch64__) && (defined(__ARM_FEATURE_SHA2) || (defined(__GNUC__) && !defined(__clang__)))
// Built where the target has SHA-2 anyway (every Apple Silicon target does),
// or by GCC, which compiles it for this one function ("+crypto": AES and
// SHA-2, what GCC's arm_neon.h asks for). Clang 14's arm_neon.h declares the
// intrinsics only for such a target, so a clang build for plain ARMv8.0 has
// the portable code alone.
#define TB_SHA256_HW "ARMv8 SHA2"
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__ARM_FEATURE_SHA2)
#define TB_ARM_SHA2
#else
#define TB_ARM_SHA2 __attribute__((target("+crypto")))
#endif

// The same compression with ARMv8's SHA-2 instructions. The state stays in
// its natural order, ABCD and EFGH, one vector each. SHA256H makes the new
// ABCD and SHA256H2 the new EFGH of four rounds, both from the old pair and
// four words W[t] + K[t]; SHA256SU0 gives W[t-16] + s0(W[t-15]) and SHA256SU1
// adds W[t-7] + s1(W[t-2]) for the next four schedule words.
TB_ARM_SHA2
static void compress_hw(uint32_t st[8], const uint8_t * p, size_t n_blocks) {
    uint32x4_t abcd = vld1q_u32(&st[0]), efgh = vld1q_u32(&st[4]);
    for (; n_blocks > 0; n_blocks--, p += 64) {
        const uint32x4_t save_abcd = abcd, save_efgh = efgh;
        uint32x4_t m[4];   // W[4g .. 4g+3] for the last four groups g, at m[g % 4]
        for (int g = 0; g < 16; g++) {
            if (g < 4) {   // the block's sixteen big-endian words
                m[g] = vreinterpretq_u32_u8(vrev32q_u8(vld1q_u8(p + 16 * g)));
            } else {
                m[g & 3] = vsha256su1q_u32(vsha256su0q_u32(m[g & 3], m[(g + 1) & 3]), m[(g + 2) & 3], m[(g + 3) & 3]);
            }
            const uint32x4_t wk = vaddq_u32(m[g & 3], vld1q_u32(&K[4 * g]));
            const uint32x4_t old_abcd = abcd;
            abcd = vsha256hq_u32(abcd, efgh, wk);
#ifndef TB_SHA256_BROKEN_ARMV8_ROUND
            efgh = vsha256h2q_u32(efgh, old_abcd, wk);
#else   // deliberately wrong (tests only): EFGH from the new ABCD
            efgh = vsha256h2q_u32(efgh, abcd, wk);
            (void) old_abcd;
#endif
        }
        abcd = vaddq_u32(abcd, save_abcd);
        efgh = vaddq_u32(efgh, save_efgh);
    }
    vst1q_u32(&st[0], abcd);
    vst1q_u32(&st[4], efgh);
}

// Every Apple Silicon CPU has them; Linux says so in the ELF auxiliary vector.
static bool cpu_has_sha_instructions(void) {
#if defined(__APPLE__) || defined(__ARM_FEATURE_SHA2)
    return true;
#elif defined(__linux__) && defined(HWCAP_SHA2)
    return (getauxval(AT_HWCAP) & HWCAP_SHA2) != 0;
#else
    return false;
#endif
}
#endif

#ifdef TB_SHA256_HW
// Which compression this process runs: the CPU's SHA instructions when it has
// them, unless TBRPC_SHA256_PORTABLE is set (tests compare both ways). Asked once.
static bool use_sha_instructions(void) {
    static int known;   // 0: not asked yet, 1: no, 2: yes
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v == 0) {
        const char * portable = getenv("TBRPC_SHA256_PORTABLE");
        v = !(portable && *portable && strcmp(portable, "0") != 0) && cpu_has_sha_instructions() ? 2 : 1;
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v == 2;
}
#endif

const char * tb_sha256_impl(void) {
#ifdef TB_SHA256_HW
    if (use_sha_instructions()) return TB_SHA256_HW;
#endif
    return "portable";
}

static void compress_blocks(uint32_t st[8], const uint8_t * p, size_t n_blocks) {
#ifdef TB_SHA256_HW
    if (use_sha_instructions()) { compress_hw(st, p, n_blocks); return; }
#endif
    for (; n_blocks > 0; n_blocks--, p += 64) compress_portable(st, p);
}

void tb_sha256_init(struct tb_sha256 * s) {
    static const uint32_t iv[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    memcpy(s->state, iv, sizeof iv);
    s->bytes = 0;
    s->used = 0;
}

void tb_sha256_update(struct tb_sha256 * s, const void * data, size_t len) {
    const uint8_t * p = data;
    s->bytes += len;
    while (len > 0) {
        if (s->used == 0 && len >= 64) {   // whole blocks straight from the caller's memory
            const size_t whole = len / 64;
            compress_blocks(s->state, p, whole);
            p += whole * 64;
            len -= whole * 64;
            continue;
        }
        size_t take = 64 - s->used < len ? 64 - s->used : len;
        memcpy(s->block + s->used, p, take);
        s->used += take;
        p += take;
        len -= take;
        if (s->used == 64) { compress_blocks(s->state, s->block, 1); s->used = 0; }
    }
}

void tb_sha256_final(struct tb_sha256 * s, uint8_t out[TB_SHA256_LEN]) {
    const uint64_t bits = s->bytes * 8;
    const uint8_t one = 0x80, zero = 0;
    tb_sha256_update(s, &one, 1);
    while (s->used != 56) tb_sha256_update(s, &zero, 1);
    uint8_t len_be[8];
    for (int i = 0; i < 8; i++) len_be[i] = (uint8_t) (bits >> (56 - 8 * i));
    tb_sha256_update(s, len_be, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t) (s->state[i] >> 24);
        out[4 * i + 1] = (uint8_t) (s->state[i] >> 16);
        out[4 * i + 2] = (uint8_t) (s->state[i] >> 8);
        out[4 * i + 3] = (uint8_t) s->state[i];
    }
    memset(s, 0, sizeof *s);
}

void tb_hmac_sha256(const uint8_t * key, size_t key_len,
                    const void * p1, size_t l1, const void * p2, size_t l2,
                    const void * p3, size_t l3, const void * p4, size_t l4,
                    uint8_t out[TB_MAC_LEN]) {
    uint8_t pad[64], inner[TB_SHA256_LEN], hashed[TB_SHA256_LEN];
    struct tb_sha256 s;
    if (key_len > sizeof pad) {   // RFC 2104: a key longer than a block is hashed first
        tb_sha256_init(&s);
        tb_sha256_update(&s, key, key_len);
        tb_sha256_final(&s, hashed);
        key = hashed;
        key_len = sizeof hashed;
    }
    memset(pad, 0x36, sizeof pad);
    for (size_t i = 0; i < key_len; i++) pad[i] ^= key[i];
    tb_sha256_init(&s);
    tb_sha256_update(&s, pad, sizeof pad);
    if (p1) tb_sha256_update(&s, p1, l1);
    if (p2) tb_sha256_update(&s, p2, l2);
    if (p3) tb_sha256_update(&s, p3, l3);
    if (p4) tb_sha256_update(&s, p4, l4);
    tb_sha256_final(&s, inner);
    memset(pad, 0x5c, sizeof pad);
    for (size_t i = 0; i < key_len; i++) pad[i] ^= key[i];
    tb_sha256_init(&s);
    tb_sha256_update(&s, pad, sizeof pad);
    tb_sha256_update(&s, inner, sizeof inner);
    tb_sha256_final(&s, out);
    memset(pad, 0, sizeof pad);
    memset(inner, 0, sizeof inner);
    memset(hashed, 0, sizeof hashed);
}

int tb_equal_ct(const uint8_t * a, const uint8_t * b, size_t len) {
    volatile uint8_t diff = 0;
    for (size_t i = 0; i < len; i++) diff |= (uint8_t) (a[i] ^ b[i]);
    return diff == 0;
}

int tb_random(void * out, size_t len) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    uint8_t * p = out;
    while (len > 0) {
        ssize_t k = read(fd, p, len);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) { close(fd); return -1; }
        p += k;
        len -= (size_t) k;
    }
    close(fd);
    return 0;
}

void tb_auth_mac(const uint8_t * secret, size_t secret_len, const char * role,
                 const uint8_t nonce_a[TB_NONCE_LEN], const uint8_t nonce_b[TB_NONCE_LEN],
                 const void * extra, size_t extra_len, uint8_t out[TB_MAC_LEN]) {
    tb_hmac_sha256(secret, secret_len, role, strlen(role) + 1, nonce_a, TB_NONCE_LEN, nonce_b, TB_NONCE_LEN,
                   extra, extra_len, out);
}
