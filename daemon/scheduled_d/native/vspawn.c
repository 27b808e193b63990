/* vspawn: start a worker's command in its run cgroup without a /bin/sh trampoline.
 *
 * Loaded with ctypes by scheduled_d/spawn.py (built by the Makefile into
 * _vspawn.so next to this file). One call, vspawn_start, does what
 * subprocess.Popen(..., start_new_session=True, close_fds=True, user=, group=,
 * extra_groups=, cwd=, env=) does in its child, plus entering the run's cgroup
 * (a write of "0" to a cgroup.procs descriptor the worker opened) before exec:
 * in this VM every exec of a dynamic binary costs ~0.45 ms of CPU, so the sh
 * trampoline's extra exec halved the worker's start rate.
 *
 * vfork: the child borrows the parent's memory until it execs or exits, so it
 * calls only async-signal-safe functions and raw system calls, allocates
 * nothing, and reports a failure as (stage, errno) over a close-on-exec pipe.
 * Credentials are changed with raw syscalls (setgroups, setresgid, setresuid,
 * in that order): glibc's setuid family would signal every thread of the
 * process it believes it is in, i.e. the worker's threads. Any failure there
 * ends the child before exec (fail closed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VSPAWN_ABI 1

/* where a failure happened: the parent names the file as Popen does */
#define STAGE_EXEC 0    /* execve: the program */
#define STAGE_SETUP 1   /* chdir, setsid, credentials, descriptors: the cwd */
#define STAGE_PARENT 2  /* pipe2 or vfork in the worker itself */

static const char enter_failed[] =
    "scheduled-d: cannot enter the run's cgroup; contained by its process group only\n";

int vspawn_abi(void) { return VSPAWN_ABI; }

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        p += n;
        len -= (size_t)n;
    }
}

static void close_from(int lowest, int keep) {
    /* every descriptor from `lowest` up except `keep` (the error pipe, close-on-exec) */
    int ok = 1;
    if (keep > lowest && syscall(SYS_close_range, (unsigned)lowest, (unsigned)keep - 1, 0) != 0)
        ok = 0;
    if (ok && syscall(SYS_close_range, (unsigned)(keep + 1), ~0U, 0) != 0)
        ok = 0;
    if (!ok) { /* no close_range (before Linux 5.9): one by one up to the limit */
        struct rlimit lim;
        long top = 65536;
        if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
            top = (long)lim.rlim_cur;
        for (long fd = lowest; fd < top; fd++)
            if (fd != keep)
                close((int)fd);
    }
}

static void __attribute__((noreturn))
child(char *const exec_list[], char *const argv[], char *const envp[], const char *cwd,
      int fd0, int fd1, int fd2, int cgroup_fd, int set_groups, int ngroups,
      const gid_t *groups, long gid, long uid, int errpipe) {
    int stage = STAGE_SETUP;
    int err = 0;
    int entered = 1;
    int fds[3] = {fd0, fd1, fd2};

    /* every signal back to its default (the handlers are the worker's, SIGPIPE and
       SIGXFSZ ignored by Python); the mask, all blocked by the parent, is emptied last */
    struct sigaction dfl = {0};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < _NSIG; sig++)
        if (sig != SIGKILL && sig != SIGSTOP)
            sigaction(sig, &dfl, NULL); /* glibc's own (32, 33) refuse: harmless */

    /* the run's cgroup first: everything from here on happens inside it */
    if (cgroup_fd >= 0 && write(cgroup_fd, "0", 1) != 1)
        entered = 0;

    /* 0, 1, 2: a source that sits on a lower target of another is moved out of the way */
    for (int i = 0; i < 3; i++) {
        if (fds[i] < 3 && fds[i] != i) {
            fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
            if (fds[i] < 0)
                goto fail;
        }
    }
    for (int i = 0; i < 3; i++) {
        if (fds[i] == i) { /* dup2 would be a no-op: clear close-on-exec by hand */
            if (fcntl(i, F_SETFD, 0) != 0)
                goto fail;
        } else if (dup2(fds[i], i) < 0) {
            goto fail;
        }
    }
    if (!entered)
        write_all(2, enter_failed, sizeof enter_failed - 1);

    if (cwd != NULL && chdir(cwd) != 0)
        goto fail;
    if (setsid() < 0)
        goto fail;
    if (set_groups && syscall(SYS_setgroups, (size_t)ngroups, groups) != 0)
        goto fail;
    if (gid >= 0 && syscall(SYS_setresgid, (gid_t)gid, (gid_t)gid, (gid_t)gid) != 0)
        goto fail;
    if (uid >= 0 && syscall(SYS_setresuid, (uid_t)uid, (uid_t)uid, (uid_t)uid) != 0)
        goto fail;

    close_from(3, errpipe);

    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) != 0)
        goto fail;

    /* the PATH search of Popen (os._execvpe): the first error that is not ENOENT or
       ENOTDIR is reported, else the last */
    stage = STAGE_EXEC;
    int saved = 0;
    for (int i = 0; exec_list[i] != NULL; i++) {
        execve(exec_list[i], argv, envp);
        if (errno != ENOENT && errno != ENOTDIR && saved == 0)
            saved = errno;
    }
    if (saved != 0)
        errno = saved;
fail:
    err = errno ? errno : EINVAL;
    {
        int report[2] = {stage, err};
        write_all(errpipe, report, sizeof report);
    }
    _exit(127);
}

/* Start the command; its pid, or -1 with *err_stage (STAGE_*) and *err_errno set.
   gid, uid: -1 to keep the worker's; set_groups: 0 to keep its supplementary groups. */
int vspawn_start(char *const exec_list[], char *const argv[], char *const envp[],
                 const char *cwd, int fd0, int fd1, int fd2, int cgroup_fd, int set_groups,
                 int ngroups, const gid_t *groups, long gid, long uid, int *err_stage,
                 int *err_errno) {
    int pipefd[2];
    *err_stage = STAGE_PARENT;
    *err_errno = 0;
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        *err_errno = errno;
        return -1;
    }
    /* volatile: the vfork child runs on this frame's stack until it execs */
    volatile int errpipe = pipefd[1];
    if (errpipe < 3) { /* not where a target of dup2 is */
        errpipe = fcntl(pipefd[1], F_DUPFD_CLOEXEC, 3);
        int saved = errno;
        close(pipefd[1]);
        if (errpipe < 0) {
            close(pipefd[0]);
            *err_errno = saved;
            return -1;
        }
    }

    /* no handler of the worker may run in the child, which shares its memory */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = vfork();
    if (pid == 0)
        child(exec_list, argv, envp, cwd, fd0, fd1, fd2, cgroup_fd, set_groups, ngroups,
              groups, gid, uid, errpipe);
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(errpipe);
    if (pid < 0) {
        close(pipefd[0]);
        *err_errno = fork_errno;
        return -1;
    }

    int report[2];
    size_t got = 0;
    while (got < sizeof report) {
        ssize_t n = read(pipefd[0], (char *)report + got, sizeof report - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(pipefd[0]);
    if (got == 0)
        return pid; /* the pipe closed on exec: started */

    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (got == sizeof report) {
        *err_stage = report[0];
        *err_errno = report[1];
    } else {
        *err_stage = STAGE_SETUP;
        *err_errno = EIO;
    }
    return -1;
}
