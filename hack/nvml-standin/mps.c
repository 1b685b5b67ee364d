/* Stand-ins for nvidia-cuda-mps-control and nvidia-cuda-mps-server (one program; argv[0] picks the role).
 *
 * What topodra and NVIDIA's drivers rely on, per the MPS guide: "-d" starts a daemon that detaches, closes
 * the stdio it inherited and writes nvidia-cuda-mps-control.pid into CUDA_MPS_PIPE_DIRECTORY; "-f" is the same
 * daemon in the foreground (no fork, stdio kept, log lines on stderr too), as NVIDIA's DRA driver runs it as a
 * pod's main process; both refuse a pipe directory whose daemon still listens ("An instance of this daemon is
 * already running").  Without an option the program is a client that sends each stdin line (get_server_list,
 * start_server -uid N, set_default_active_thread_percentage N, set_default_device_pinned_mem_limit DEV VALUE,
 * their get_ forms, quit) to the daemon through the pipe directory and prints the answers.  The reply FIFO is
 * named relative to the pipe directory, since a daemon in a pod sees that directory under another path.  The
 * daemon and each server keep a file in /dev/shm, which is how tests see that clients and daemon share one
 * /dev/shm.  SIGTERM ends the daemon as "quit" does (a deleted daemon pod).  A server is a GPU process to the
 * NVML stand-in (register_process): NVML lists it and refuses to destroy the compute instance it runs on.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char pipe_dir[PATH_MAX], log_dir[PATH_MAX], pid_file[PATH_MAX], control[PATH_MAX], shm_file[PATH_MAX];
static FILE *logf_, *echo_; /* control.log; stderr too in the foreground */

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

static void logline(const char *fmt, ...) {
    if (!logf_) return;
    time_t now = time(NULL);
    char ts[32];
    strftime(ts, sizeof ts, "%Y-%m-%d %H:%M:%S", localtime(&now));
    fprintf(logf_, "[%s.000 Control %d] ", ts, (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    vfprintf(logf_, fmt, ap);
    va_end(ap);
    fputc('\n', logf_);
    fflush(logf_);
    if (echo_) {
        fprintf(echo_, "[%s.000 Control %d] ", ts, (int)getpid());
        va_start(ap, fmt);
        vfprintf(echo_, fmt, ap);
        va_end(ap);
        fputc('\n', echo_);
        fflush(echo_);
    }
}

/* ---- server */

static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }

/* A GPU context, as NVML sees it: the server registers itself with the NVML stand-in (nvml.c, live_procs) on
 * the devices its daemon's CUDA_VISIBLE_DEVICES names ("all" when unset), in
 * TOPODRA_NVML_STANDIN_PROCESSES or <this program's dir>/../lib/x86_64-linux-gnu/nvml-standin-processes.  The
 * file is written under a temporary name, flock'ed, then renamed, and the lock lasts as long as the process:
 * NVML answers IN_USE for a compute instance it runs on until it exits, however it exits.  A tree it cannot
 * write (a read-only mount in a pod) leaves it unregistered, and says so. */
static char proc_file[PATH_MAX];

static void register_process(const char *self_dir) {
    char dir[PATH_MAX], tmp[PATH_MAX + 32];
    snprintf(dir, sizeof dir, "%s", env_or("TOPODRA_NVML_STANDIN_PROCESSES", ""));
    if (!dir[0]) snprintf(dir, sizeof dir, "%s/../lib/x86_64-linux-gnu/nvml-standin-processes", self_dir);
    mkdir(dir, 0755);
    snprintf(tmp, sizeof tmp, "%s/.new.%d", dir, (int)getpid());
    snprintf(proc_file, sizeof proc_file, "%s/%d", dir, (int)getpid());
    int fd = open(tmp, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0 || flock(fd, LOCK_EX) != 0 || dprintf(fd, "devices %s\n", env_or("CUDA_VISIBLE_DEVICES", "all")) < 0 ||
        rename(tmp, proc_file) != 0) {
        fprintf(stderr, "nvidia-cuda-mps-server (stand-in): NVML will not see this process: cannot register in %s: "
                "%s\n", dir, strerror(errno));
        if (fd >= 0) { unlink(tmp); close(fd); }
        proc_file[0] = 0;
        return;
    }
    /* fd stays open (and locked) until exit */
}

static int server(const char *self_dir) {
    register_process(self_dir);
    snprintf(shm_file, sizeof shm_file, "/dev/shm/cuda.shm.standin.%d", (int)getpid());
    int fd = open(shm_file, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) { fprintf(stderr, "nvidia-cuda-mps-server: cannot create %s: %s\n", shm_file, strerror(errno)); return 1; }
    close(fd);
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    while (!stop) pause();
    unlink(shm_file);
    if (proc_file[0]) unlink(proc_file);
    return 0;
}

/* ---- daemon */

#define MAX_SERVERS 16
static pid_t servers[MAX_SERVERS];
static int nservers;
static char thread_pct[32] = "100.0";
/* Pinned-memory limits keyed by the device as given: an index or a UUID (NVIDIA's DRA driver sends UUIDs). */
#define MAX_LIMITS 64
static char limit_dev[MAX_LIMITS][96], limit_val[MAX_LIMITS][32];
static int nlimits;

static int limit_slot(const char *dev, int create) {
    for (int i = 0; i < nlimits; i++)
        if (!strcmp(limit_dev[i], dev)) return i;
    if (!create || nlimits >= MAX_LIMITS) return -1;
    snprintf(limit_dev[nlimits], sizeof limit_dev[0], "%s", dev);
    return nlimits++;
}

static int valid_dev(const char *dev) {
    if (!strncmp(dev, "GPU-", 4) || !strncmp(dev, "MIG-", 4)) return strlen(dev) < sizeof limit_dev[0];
    char *end;
    long i = strtol(dev, &end, 10);
    return *dev && !*end && i >= 0 && i < 64;
}

static void reap(void) {
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0)
        for (int i = 0; i < nservers; i++)
            if (servers[i] == p) { servers[i] = servers[--nservers]; break; }
}

static void start_server(FILE *out, const char *self_dir) {
    if (nservers >= MAX_SERVERS) { fprintf(out, "Too many servers\n"); return; }
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/nvidia-cuda-mps-server", self_dir);
    pid_t p = fork();
    if (p == 0) {
        execl(path, "nvidia-cuda-mps-server", (char *)NULL);
        _exit(127);
    }
    if (p < 0) { fprintf(out, "Cannot start server: %s\n", strerror(errno)); return; }
    servers[nservers++] = p;
    logline("Starting new server %d", (int)p);
    fprintf(out, "%d\n", (int)p);
}

static void cleanup(void) {
    for (int i = 0; i < nservers; i++) kill(servers[i], SIGTERM);
    for (int i = 0; i < nservers; i++) waitpid(servers[i], NULL, 0);
    nservers = 0;
    unlink(pid_file);
    unlink(control);
    unlink(shm_file);
}

/* One command; returns 1 after quit. */
static int handle(char *cmd, FILE *out, const char *self_dir) {
    char *argv[8];
    int argc = 0;
    for (char *t = strtok(cmd, " \t\r\n"); t && argc < 8; t = strtok(NULL, " \t\r\n")) argv[argc++] = t;
    if (!argc) return 0;
    reap();
    if (!strcmp(argv[0], "get_server_list")) {
        for (int i = 0; i < nservers; i++) fprintf(out, "%d\n", (int)servers[i]);
    } else if (!strcmp(argv[0], "start_server") && argc == 3 && !strcmp(argv[1], "-uid")) {
        start_server(out, self_dir);
    } else if (!strcmp(argv[0], "set_default_active_thread_percentage") && argc == 2) {
        snprintf(thread_pct, sizeof thread_pct, "%.1f", atof(argv[1]));
        fprintf(out, "%s\n", thread_pct);
    } else if (!strcmp(argv[0], "get_default_active_thread_percentage") && argc == 1) {
        fprintf(out, "%s\n", thread_pct);
    } else if (!strcmp(argv[0], "set_default_device_pinned_mem_limit") && argc == 3) {
        int i = valid_dev(argv[1]) ? limit_slot(argv[1], 1) : -1;
        if (i < 0) fprintf(out, "Invalid device %s\n", argv[1]);
        else snprintf(limit_val[i], sizeof limit_val[i], "%s", argv[2]);
    } else if (!strcmp(argv[0], "get_default_device_pinned_mem_limit") && argc == 2) {
        int i = limit_slot(argv[1], 0);
        fprintf(out, "%s\n", i >= 0 ? limit_val[i] : "0");
    } else if (!strcmp(argv[0], "quit")) {
        logline("CMD: quit");
        return 1;
    } else {
        fprintf(out, "Unrecognized command %s\n", argv[0]);
    }
    return 0;
}

/* Whether a daemon reads the control FIFO of this pipe directory (its own pid file may name a pid of another
 * PID namespace, or a reused one, so it proves nothing). */
static int listening(void) {
    int fd = open(control, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return 0; /* ENXIO: no reader; ENOENT: no FIFO */
    close(fd);
    return 1;
}

/* The checks of -d and -f: the directories exist, and no daemon serves this pipe directory yet. */
static int claim_dirs(void) {
    if (mkdir(pipe_dir, 0755) != 0 && errno != EEXIST) { perror(pipe_dir); return 1; }
    if (mkdir(log_dir, 0755) != 0 && errno != EEXIST) { perror(log_dir); return 1; }
    if (listening()) { fprintf(stderr, "An instance of this daemon is already running\n"); return 1; }
    return 0;
}

/* Make the FIFO, shm file and pid file, say so on ready_fd (-1: nobody waits), then serve until quit or SIGTERM. */
static int serve(const char *self_dir, int ready_fd) {
    char logpath[PATH_MAX + 16];
    snprintf(logpath, sizeof logpath, "%s/control.log", log_dir);
    logf_ = fopen(logpath, "ae");
    unlink(control);
    if (mkfifo(control, 0600) != 0) { logline("cannot create %s: %s", control, strerror(errno)); return 1; }
    int fd = open(control, O_RDWR | O_CLOEXEC); /* a reader always, and never EOF */
    snprintf(shm_file, sizeof shm_file, "/dev/shm/cuda.shm.standin.control.%d", (int)getpid());
    int shm = open(shm_file, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    FILE *pidf = fopen(pid_file, "w");
    if (fd < 0 || shm < 0 || !pidf) { logline("startup failed: %s", strerror(errno)); return 1; }
    close(shm);
    fprintf(pidf, "%d\n", (int)getpid());
    fclose(pidf);
    logline("Starting control daemon, pipe directory %s", pipe_dir);
    if (ready_fd >= 0) {
        ssize_t w = write(ready_fd, "y", 1);
        (void)w;
        close(ready_fd);
    }
    /* No SA_RESTART: SIGTERM interrupts the blocking read, so the loop ends and cleans up. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN); /* a client that dies while we answer costs that answer (EPIPE), not the daemon */
    FILE *in = fdopen(fd, "r");
    char line[512];
    while (!stop && fgets(line, sizeof line, in)) {
        char *space = strchr(line, ' ');
        if (!space) continue;
        *space = 0;
        char reply[PATH_MAX * 2];
        if (strchr(line, '/')) snprintf(reply, sizeof reply, "%s", line);
        else snprintf(reply, sizeof reply, "%s/%s", pipe_dir, line);
        /* The client opened its reply FIFO for reading before it wrote the command, so a writer's open succeeds at
         * once while it lives. O_NONBLOCK: a client killed since then leaves no reader, and open fails with ENXIO
         * (fifo(7)) instead of blocking the daemon for every later client. */
        int rfd = open(reply, O_WRONLY | O_NONBLOCK | O_CLOEXEC); /* not inherited by a server we start */
        if (rfd < 0) { /* the command was sent, so it is carried out; only its answer has nowhere to go */
            logline("no client reads %s (%s): answer dropped", line, strerror(errno));
            rfd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        }
        if (rfd >= 0) fcntl(rfd, F_SETFL, fcntl(rfd, F_GETFL) & ~O_NONBLOCK);
        FILE *out = rfd >= 0 ? fdopen(rfd, "w") : NULL;
        if (!out) { if (rfd >= 0) close(rfd); continue; }
        logline("CMD: %s", space + 1);
        int quit = handle(space + 1, out, self_dir);
        fclose(out);
        if (quit) break;
    }
    if (stop) logline("Terminated by signal");
    cleanup();
    logline("Exit");
    return 0;
}

static int daemon_main(const char *self_dir) {
    if (claim_dirs()) return 1;
    int ready[2];
    if (pipe(ready) != 0) { perror("pipe"); return 1; }
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child > 0) { /* the foreground process returns once the daemon is ready */
        close(ready[1]);
        char ok = 0;
        ssize_t n = read(ready[0], &ok, 1);
        return n == 1 && ok == 'y' ? 0 : 1;
    }
    close(ready[0]);
    setsid();
    if (fork() > 0) _exit(0);
    /* Detach from whatever stdio the caller gave us, so a caller capturing our output sees EOF. */
    int nul = open("/dev/null", O_RDWR);
    dup2(nul, 0); dup2(nul, 1); dup2(nul, 2);
    if (nul > 2) close(nul);
    return serve(self_dir, ready[1]);
}

static int foreground_main(const char *self_dir) {
    if (claim_dirs()) return 1;
    echo_ = stderr;
    return serve(self_dir, -1);
}

/* ---- client */

static int client(void) {
    char line[400];
    int n = 0, rc = 0;
    while (fgets(line, sizeof line, stdin)) {
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        int fd = open(control, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) { fprintf(stderr, "Cannot find MPS control daemon process\n"); return 1; }
        char reply[PATH_MAX];
        char name[64];
        snprintf(name, sizeof name, "reply.%d.%d", (int)getpid(), n++);
        snprintf(reply, sizeof reply, "%s/%s", pipe_dir, name);
        unlink(reply);
        if (mkfifo(reply, 0600) != 0) { perror(reply); close(fd); return 1; }
        /* Reader first (O_NONBLOCK: no writer yet), so the daemon's non-blocking open finds us (see serve). */
        int rfd = open(reply, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        if (rfd < 0) { perror(reply); close(fd); unlink(reply); return 1; }
        char msg[PATH_MAX + 400];
        int len = snprintf(msg, sizeof msg, "%s %s%s", name, line, strchr(line, '\n') ? "" : "\n");
        if (write(fd, msg, (size_t)len) != len) { perror("write"); rc = 1; }
        close(fd);
        /* Until the daemon has opened and closed its end: on Linux a FIFO reader polls POLLHUP only once a writer
         * has come and gone (pipe_poll), so poll waits for the answer rather than reading an early EOF. */
        char buf[256];
        struct pollfd p = {.fd = rfd, .events = POLLIN};
        while (rc == 0 && poll(&p, 1, -1) >= 0) {
            ssize_t got = read(rfd, buf, sizeof buf);
            if (got > 0) { fwrite(buf, 1, (size_t)got, stdout); continue; }
            if (got == 0 || errno != EAGAIN) break;
        }
        fflush(stdout);
        close(rfd);
        unlink(reply);
        if (!strncmp(line, "quit", 4)) break;
    }
    return rc;
}

int main(int argc, char **argv) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    char *self_dir = dirname(self);
    const char *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    if (!strcmp(base, "nvidia-cuda-mps-server")) return server(self_dir);
    snprintf(pipe_dir, sizeof pipe_dir, "%s", env_or("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"));
    snprintf(log_dir, sizeof log_dir, "%s", env_or("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"));
    snprintf(pid_file, sizeof pid_file, "%s/nvidia-cuda-mps-control.pid", pipe_dir);
    snprintf(control, sizeof control, "%s/control", pipe_dir);
    if (argc == 2 && !strcmp(argv[1], "-d")) return daemon_main(self_dir);
    if (argc == 2 && !strcmp(argv[1], "-f")) return foreground_main(self_dir);
    if (argc == 1) return client();
    fprintf(stderr, "nvidia-cuda-mps-control (topodra stand-in): unsupported arguments; use -d, -f or commands "
            "on stdin\n");
    return 2;
}
