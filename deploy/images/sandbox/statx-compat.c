/* afe-statx.so: `ls -l` and `stat` under gVisor.
 *
 * Debian bookworm's runsc (20221219) refuses statx(2) with AT_NO_AUTOMOUNT
 * ("Invalid argument"), and bookworm's coreutils pass that flag: `ls -l`,
 * `ls -la`, `ls -R` and `stat` fail in a gVisor sandbox. gVisor mounts
 * nothing automatically, so the flag means nothing there: this library,
 * preloaded into every program of afe's images (/etc/ld.so.preload), asks
 * again without it when the kernel refuses it. On Linux (runc) the first
 * call succeeds and nothing changes.
 *
 * It calls the system call itself (no dlsym), so it needs nothing of the C
 * library newer than `syscall` and `errno` (GLIBC_2.2.5) and loads into any
 * glibc image. Built on the host by services/sandbox/containers/images.py:
 *     gcc -shared -fPIC -O2 -Wall -Werror -s -o afe-statx.so statx-compat.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *restrict path, int flags, unsigned int mask, struct statx *restrict buf)
{
    long r = syscall(SYS_statx, dirfd, path, flags, mask, buf);
    if (r < 0 && errno == EINVAL && (flags & AT_NO_AUTOMOUNT))
        r = syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
    return (int) r;
}
