// check.h - what the C test programs share: CHECK, and for the ones that
// fork a peer, its exit status and a byte pattern both sides can compute.
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>

// Stop the test with a message naming the line, when cond is false.
#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

// A child's exit code, or 128 + the signal that ended it.
static inline int child_status(pid_t pid) {
    int st = 0;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Byte i of a stream, different per salt, so a lost, repeated or misplaced byte shows.
static inline uint8_t pattern(uint64_t i, uint32_t salt) { return (uint8_t) ((i * 2654435761u) >> 13 ^ salt); }
