// auth_tests.c - SHA-256 against FIPS 180-4's and NIST's examples, HMAC-SHA256 against
// all seven test cases of RFC 4231 (case 5 compares the first 128 bits, as
// the RFC does), the constant-time comparison, roles and nonces. Prints
// which SHA-256 compression ran, then "PASS", or every failure and exits 1.
// With the argument "digests", the SHA-256 of messages on stdin instead.
#include "auth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

static void from_hex(const char * hex, uint8_t * out, size_t * len) {
    size_t n = strlen(hex) / 2;
    for (size_t i = 0; i < n; i++) { unsigned v; sscanf(hex + 2 * i, "%2x", &v); out[i] = (uint8_t) v; }
    *len = n;
}

static void expect(const char * what, const uint8_t * got, const char * want_hex) {
    uint8_t want[64];
    size_t len;
    from_hex(want_hex, want, &len);
    if (memcmp(got, want, len) != 0) {
        fprintf(stderr, "FAIL %s: got ", what);
        for (size_t i = 0; i < len; i++) fprintf(stderr, "%02x", got[i]);
        fprintf(stderr, ", want %s\n", want_hex);
        failures++;
    }
}

// SHA-256 of data fed in uneven pieces (the block boundary logic must not
// care), or in one call (whole blocks go to the compression in one run).
static void digest(const void * data, size_t len, int in_pieces, uint8_t out[TB_SHA256_LEN]) {
    struct tb_sha256 s;
    tb_sha256_init(&s);
    const uint8_t * p = data;
    if (!in_pieces) tb_sha256_update(&s, p, len);
    for (size_t done = 0, step = 1; in_pieces && done < len; done += step, step = step * 3 % 67 + 1)
        tb_sha256_update(&s, p + done, done + step > len ? len - done : step);
    tb_sha256_final(&s, out);
}

static void sha(const char * what, const void * data, size_t len, const char * want) {
    uint8_t out[TB_SHA256_LEN];
    for (int in_pieces = 0; in_pieces < 2; in_pieces++) {
        digest(data, len, in_pieces, out);
        expect(what, out, want);
    }
}

// "digests": messages on stdin, each a u32 little-endian length and its bytes;
// for each, a line with its SHA-256 in hex, fed in one call and in pieces.
static int digests(void) {
    uint8_t len_le[4], out[TB_SHA256_LEN];
    while (fread(len_le, 1, 4, stdin) == 4) {
        size_t len = (size_t) len_le[0] | (size_t) len_le[1] << 8 | (size_t) len_le[2] << 16 | (size_t) len_le[3] << 24;
        uint8_t * data = malloc(len ? len : 1);
        if (!data || fread(data, 1, len, stdin) != len) { fprintf(stderr, "short message on stdin\n"); free(data); return 1; }
        for (int in_pieces = 0; in_pieces < 2; in_pieces++) {
            digest(data, len, in_pieces, out);
            for (int i = 0; i < TB_SHA256_LEN; i++) printf("%02x", out[i]);
            printf(in_pieces ? "\n" : " ");
        }
        free(data);
    }
    return 0;
}

static void hmac(const char * what, const uint8_t * key, size_t key_len, const void * data, size_t len, const char * want) {
    uint8_t out[TB_MAC_LEN];
    tb_hmac_sha256(key, key_len, data, len, NULL, 0, NULL, 0, NULL, 0, out);
    expect(what, out, want);
    // the same message split into parts gives the same MAC
    const uint8_t * p = data;
    size_t a = len / 3, b = len / 2 - a;
    tb_hmac_sha256(key, key_len, p, a, p + a, b, NULL, 0, p + a + b, len - a - b, out);
    expect(what, out, want);
}

int main(int argc, char ** argv) {
    printf("sha256: %s\n", tb_sha256_impl());
    if (argc == 2 && strcmp(argv[1], "digests") == 0) return digests();
    sha("sha256 abc", "abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    sha("sha256 empty", "", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char * two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    sha("sha256 448 bits", two, strlen(two), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    const char * four = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrs"
                        "mnopqrstnopqrstu";
    sha("sha256 896 bits", four, strlen(four), "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
    char * million = malloc(1000000);
    memset(million, 'a', 1000000);
    sha("sha256 million a", million, 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(million);

    uint8_t key[64], data[64];
    size_t key_len, data_len;
    // RFC 4231 test case 1
    memset(key, 0x0b, 20);
    hmac("rfc4231 case 1", key, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
    // case 2
    hmac("rfc4231 case 2", (const uint8_t *) "Jefe", 4, "what do ya want for nothing?", 28,
         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    // case 3
    memset(key, 0xaa, 20);
    memset(data, 0xdd, 50);
    hmac("rfc4231 case 3", key, 20, data, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
    // case 4
    from_hex("0102030405060708090a0b0c0d0e0f10111213141516171819", key, &key_len);
    memset(data, 0xcd, 50);
    hmac("rfc4231 case 4", key, key_len, data, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
    // case 5 (output truncated to 128 bits)
    memset(key, 0x0c, 20);
    hmac("rfc4231 case 5", key, 20, "Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b");
    // case 6: a key larger than a block (hashed first)
    uint8_t big[131];
    memset(big, 0xaa, sizeof big);
    const char * m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    hmac("rfc4231 case 6", big, sizeof big, m6, strlen(m6), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    // case 7: key and data larger than a block
    const char * m7 = "This is a test using a larger than block-size key and a larger than block-size data. "
                      "The key needs to be hashed before being used by the HMAC algorithm.";
    hmac("rfc4231 case 7", big, sizeof big, m7, strlen(m7), "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
    (void) data_len;

    // constant-time comparison: equal, and different in the first or the last byte
    uint8_t a[TB_MAC_LEN] = { 0 }, b[TB_MAC_LEN] = { 0 };
    if (!tb_equal_ct(a, b, sizeof a)) { fprintf(stderr, "FAIL equal MACs compare unequal\n"); failures++; }
    b[0] = 1;
    if (tb_equal_ct(a, b, sizeof a)) { fprintf(stderr, "FAIL first byte differs, compared equal\n"); failures++; }
    b[0] = 0; b[TB_MAC_LEN - 1] = 0x80;
    if (tb_equal_ct(a, b, sizeof a)) { fprintf(stderr, "FAIL last byte differs, compared equal\n"); failures++; }

    // nonces: two draws differ
    uint8_t n1[TB_NONCE_LEN], n2[TB_NONCE_LEN];
    if (tb_random(n1, sizeof n1) != 0 || tb_random(n2, sizeof n2) != 0 || memcmp(n1, n2, sizeof n1) == 0) {
        fprintf(stderr, "FAIL nonces\n");
        failures++;
    }
    // roles keep MACs apart: the head's proof is never the node's
    uint8_t s[32] = { 7 }, m1[TB_MAC_LEN], m2[TB_MAC_LEN];
    tb_auth_mac(s, sizeof s, "head", n1, n2, NULL, 0, m1);
    tb_auth_mac(s, sizeof s, "node", n1, n2, NULL, 0, m2);
    if (tb_equal_ct(m1, m2, sizeof m1)) { fprintf(stderr, "FAIL roles give the same MAC\n"); failures++; }

    if (failures) return 1;
    printf("PASS\n");
    return 0;
}
