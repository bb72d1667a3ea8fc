// transport/qp_budget.c - RDMA QP places per (host, device), each held by an
// exclusive flock() on a file of its own (why: qp_budget.h).
#include "qp_budget.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

int tb_qp_dir(char * dir, size_t dir_len, char * why, size_t why_len) {
    const char * set = getenv("TBRPC_QP_DIR");
    const char * runtime = getenv("XDG_RUNTIME_DIR");
    const char * tmp = getenv("TMPDIR");
    int n;
    if (set && *set) n = snprintf(dir, dir_len, "%s", set);
    else if (runtime && *runtime) n = snprintf(dir, dir_len, "%s/tbrpc-qp", runtime);
    else n = snprintf(dir, dir_len, "%s/tbrpc-qp-%u", tmp && *tmp ? tmp : "/tmp", (unsigned) getuid());
    if (n < 0 || (size_t) n >= dir_len) {
        snprintf(why, why_len, "QP budget: the name of its directory is too long");
        return -1;
    }
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        snprintf(why, why_len, "QP budget: cannot make %s: %s", dir, strerror(errno));
        return -1;
    }
    struct stat st;
    if (lstat(dir, &st) != 0) {
        snprintf(why, why_len, "QP budget: cannot see %s: %s", dir, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode) || st.st_uid != getuid() || (st.st_mode & 022) != 0) {
        snprintf(why, why_len, "QP budget: %s is not a directory of this user's that only it may write", dir);
        return -1;
    }
    return 0;
}

int tb_qp_take(uint64_t host_id, const char * device, int limit, int * place, char * why, size_t why_len) {
    *place = -1;
    if (limit <= 0) return TB_QP_TAKEN;
    char dir[512];
    if (tb_qp_dir(dir, sizeof dir, why, why_len) != 0) return TB_QP_NO_PLACES;
    char name[32];   // the device's name as a file name: letters, digits, '.', '-', '_'
    size_t len = 0;
    for (; device[len] && len < sizeof name - 1; len++) {
        char ch = device[len];
        int plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    ch == '.' || ch == '-' || ch == '_';
        name[len] = plain ? ch : '_';
    }
    name[len] = '\0';
    for (int k = 0; k < limit; k++) {
        char path[640];
        int n = snprintf(path, sizeof path, "%s/qp-%016llx-%s.%d", dir, (unsigned long long) host_id, name, k);
        if (n < 0 || (size_t) n >= sizeof path) {
            snprintf(why, why_len, "QP budget: the name of a place in %s is too long", dir);
            return TB_QP_NO_PLACES;
        }
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) {
            snprintf(why, why_len, "QP budget: cannot open %s: %s", path, strerror(errno));
            return TB_QP_NO_PLACES;
        }
#ifdef TB_QP_BROKEN_PROCESS_LOCKS   // deliberately wrong (tests only): a record lock, which a process holds once
        struct flock record = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
        int locked = fcntl(fd, F_SETLK, &record) == 0;
#else
        int locked = flock(fd, LOCK_EX | LOCK_NB) == 0;
#endif
        if (locked) {
            *place = fd;
            return TB_QP_TAKEN;
        }
        int e = errno;
        close(fd);
        if (e != EWOULDBLOCK && e != EAGAIN && e != EACCES) {
            snprintf(why, why_len, "QP budget: cannot lock %s: %s", path, strerror(e));
            return TB_QP_NO_PLACES;
        }
    }
    snprintf(why, why_len, "QP budget: %d of %d in use on %s", limit, limit, device);
    return TB_QP_SPENT;
}

void tb_qp_give(int place) {
    if (place >= 0) close(place);   // the lock goes with the last descriptor of the open file
}
