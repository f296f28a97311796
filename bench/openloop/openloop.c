/*
 * openloop: a small arrival-rate (open-loop) HTTP/1.1 load generator.
 *
 * Why it exists. A closed-loop generator (wrk, load.py) sends a connection's next request
 * only when the last one has finished. When the server stalls, the generator stalls with
 * it and simply does not send the requests a real user population would have sent during
 * the stall: those requests never appear in the latency record ("coordinated omission"),
 * so a 300 ms stall shows as one slow request per connection. Users arrive at a rate,
 * whatever the server is doing. This generator sends requests on a fixed schedule —
 * request i is due at t0 + i / rate — and measures each request's latency from that
 * *intended* send time, so every request scheduled during a stall carries the part of the
 * stall it waited through.
 *
 * Model. One thread, one epoll loop, N keep-alive connections opened before t0. A due
 * request goes to any idle connection (one request in flight per connection, no
 * pipelining). When every connection is busy, due requests wait in the generator; their
 * latency still counts from their intended time (that queue is the server's doing: it is
 * what a user would see). Rate 0 is the closed loop (each connection sends again as soon
 * as its response is complete; latency from the actual send), used to measure capacity
 * with the same client code.
 *
 * Responses are read to the end: Content-Length, chunked (SSE streams arrive chunked), or
 * until the server closes. A response counts as ok when its status is 2xx and, with
 * --expect, its body contains that string (e.g. "[DONE]" for a stream). Latencies are
 * kept as samples and sorted at the end (exact percentiles; 150k requests are ~4 MB).
 *
 * Output: one JSON line on stdout. Only libc (Linux: epoll, timerfd).
 *
 *   openloop --url http://127.0.0.1:18000/v1/chat/completions --rate 2000 \
 *            --connections 64 --duration 10 --body body.json \
 *            --header 'Authorization: Bearer sk-x' --expect '"choices"'
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define BUFSZ 65536     /* per-connection read buffer: a response head must fit in it */
#define MAX_HEADERS 16  /* extra request headers (--header) */
#define MAX_EXPECT 256  /* longest --expect string */
#define NS 1000000000LL /* nanoseconds per second */

/* ------------------------------------------------------------------ small helpers */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * NS + ts.tv_nsec;
}

static void die(const char *msg) {
    fprintf(stderr, "openloop: %s\n", msg);
    exit(2);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) die("out of memory");
    return q;
}

/* ------------------------------------------------------------------ the run's state */

/* Why a request failed; each kind has its own counter in the JSON. */
enum err_kind { E_CONNECT, E_READ, E_CLOSED, E_STATUS, E_BODY, E_PARSE, E_TIMEOUT, E_KINDS };
static const char *ERR_NAMES[E_KINDS] = {"connect", "read", "closed", "status",
                                         "body", "parse", "timeout"};

enum conn_state { C_DOWN, C_CONNECTING, C_IDLE, C_BUSY };

/* Where the response parser is: the head, then one of the three body framings. */
enum parse_state {
    P_HEAD,       /* status line and headers, up to the empty line */
    P_LEN,        /* Content-Length body: `remaining` bytes left */
    P_CHUNK_SIZE, /* chunked: the hex size line of the next chunk */
    P_CHUNK_DATA, /* chunked: `remaining` bytes of chunk data left */
    P_CHUNK_CRLF, /* chunked: the CRLF after a chunk's data */
    P_TRAILER,    /* chunked: trailer lines after the 0-size chunk, up to the empty line */
    P_EOF         /* no framing: the body ends when the server closes */
};

typedef struct {
    int fd;
    uint32_t gen;        /* bumped by every (re)open: epoll events of a closed socket are stale */
    enum conn_state state;
    int64_t retry_at;    /* C_DOWN: when to connect again (after a failed connect) */
    /* the request in flight (C_BUSY) */
    int64_t intended;    /* when the schedule said to send it */
    int64_t sent;        /* when it was written */
    int64_t first_byte;  /* first response byte, 0 until then */
    size_t wpos;         /* bytes of the request written so far */
    /* the response being parsed */
    enum parse_state ps;
    int status;
    int close_after;     /* "Connection: close" or HTTP/1.0: reconnect after it */
    int64_t remaining;
    int found;           /* --expect seen in the body */
    char tail[MAX_EXPECT];
    size_t tail_len;     /* last bytes of the body, to find --expect across reads */
    size_t blen;
    char buf[BUFSZ];
} conn_t;

/* One finished request (ok or not): kept for the percentiles and --samples. */
typedef struct {
    int64_t intended; /* offset from t0, ns */
    int64_t latency;  /* intended -> last byte, ns */
    int64_t ttfb;     /* intended -> first response byte, ns (-1 if none) */
    int64_t lag;      /* intended -> actually written, ns (-1 if never written) */
    int status;       /* HTTP status, or -1 - err_kind when it failed before a status */
    int ok;
} sample_t;

static struct {
    /* options */
    char host[256], port[16], path[2048];
    double rate, duration, timeout;
    int nconns;
    const char *body_file, *label, *samples_file;
    char expect[MAX_EXPECT];
    size_t expect_len;
    const char *headers[MAX_HEADERS];
    int nheaders;
    /* the request, built once */
    char *req;
    size_t req_len;
    struct addrinfo *addr;
    /* the loop */
    int ep, tfd;
    conn_t *conns;
    int *idle; /* stack of idle connection indices */
    int nidle;
    int64_t t0, end_sched; /* schedule window [t0, end_sched) */
    int64_t total;         /* open loop: requests on the schedule */
    int64_t next;          /* open loop: index of the next request to dispatch */
    int64_t queued_max;    /* most due requests waiting for a free connection */
    int sending;           /* closed loop: still sending */
    /* results */
    sample_t *samples;
    size_t nsamples, cap;
    int64_t errors[E_KINDS];
    int64_t ok, ok_in_window, sent;
    int64_t last_done;
} G;

/* ------------------------------------------------------------------ recording */

static void record(int64_t intended, int64_t sent, int64_t first_byte, int64_t done, int status,
                   int ok) {
    if (G.nsamples == G.cap) {
        G.cap = G.cap ? G.cap * 2 : 4096;
        G.samples = xrealloc(G.samples, G.cap * sizeof(sample_t));
    }
    sample_t *s = &G.samples[G.nsamples++];
    s->intended = intended - G.t0;
    s->latency = done - intended;
    s->ttfb = first_byte ? first_byte - intended : -1;
    s->lag = sent ? sent - intended : -1;
    s->status = status;
    s->ok = ok;
    if (ok) {
        G.ok++;
        if (done <= G.end_sched) G.ok_in_window++;
    }
    if (done > G.last_done) G.last_done = done;
}

static void fail(enum err_kind kind, int64_t intended, int64_t sent, int64_t first_byte,
                 int status) {
    G.errors[kind]++;
    record(intended, sent, first_byte, now_ns(), status ? status : -1 - (int)kind, 0);
}

/* ------------------------------------------------------------------ connections */

static void ep_set(conn_t *c, uint32_t events, int op) {
    struct epoll_event ev = {.events = events,
                             .data.u64 = (uint64_t)c->gen << 32 | (uint32_t)(c - G.conns)};
    if (epoll_ctl(G.ep, op, c->fd, &ev) < 0) die("epoll_ctl failed");
}

static void push_idle(conn_t *c) {
    c->state = C_IDLE;
    G.idle[G.nidle++] = (int)(c - G.conns);
}

static void conn_open(conn_t *c) {
    c->fd = socket(G.addr->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0) die("socket() failed (raise ulimit -n?)");
    c->gen++;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->blen = 0;
    if (connect(c->fd, G.addr->ai_addr, G.addr->ai_addrlen) == 0) {
        ep_set(c, EPOLLIN, EPOLL_CTL_ADD);
        push_idle(c);
    } else if (errno == EINPROGRESS) {
        c->state = C_CONNECTING; /* writable = connected (or failed: SO_ERROR says) */
        ep_set(c, EPOLLOUT, EPOLL_CTL_ADD);
    } else {
        close(c->fd);
        c->fd = -1;
        c->state = C_DOWN;
        c->retry_at = now_ns() + NS / 100;
        G.errors[E_CONNECT]++;
    }
}

/* Close a connection (whatever it was doing) and open it again; an idle one leaves the
 * idle stack first. The caller has already accounted for any request in flight. */
static void conn_reset(conn_t *c) {
    if (c->state == C_IDLE) {
        for (int i = 0; i < G.nidle; i++)
            if (G.idle[i] == (int)(c - G.conns)) {
                G.idle[i] = G.idle[--G.nidle];
                break;
            }
    }
    if (c->fd >= 0) close(c->fd); /* close() also removes it from the epoll set */
    c->fd = -1;
    c->state = C_DOWN;
    c->retry_at = 0;
    conn_open(c);
}

/* The request in flight on `c` failed: count it, then start over on a new connection. */
static void conn_fail(conn_t *c, enum err_kind kind) {
    if (c->state == C_BUSY) fail(kind, c->intended, c->sent, c->first_byte, c->status);
    conn_reset(c);
}

/* Write what is left of the request; wait for EPOLLOUT when the socket buffer is full. */
static void conn_write(conn_t *c) {
    while (c->wpos < G.req_len) {
        ssize_t n = send(c->fd, G.req + c->wpos, G.req_len - c->wpos, MSG_NOSIGNAL);
        if (n > 0) {
            c->wpos += (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            ep_set(c, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
            return;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else {
            conn_fail(c, E_READ); /* the peer went away: same kind as a failed read */
            return;
        }
    }
}

/* Start a request on idle connection `c`, due at `intended`. */
static void conn_send(conn_t *c, int64_t intended) {
    c->state = C_BUSY;
    c->intended = intended;
    c->sent = now_ns();
    c->first_byte = 0;
    c->wpos = 0;
    c->ps = P_HEAD;
    c->status = 0;
    c->close_after = 0;
    c->remaining = 0;
    c->found = G.expect_len == 0;
    c->tail_len = 0;
    c->blen = 0;
    G.sent++;
    conn_write(c);
}

/* ------------------------------------------------------------------ response parsing */

/* Body bytes arrived: look for --expect in them, across read boundaries too. */
static void body_bytes(conn_t *c, const char *p, size_t n) {
    if (c->found || n == 0) return;
    size_t k = G.expect_len - 1; /* bytes of context a match may need from before */
    /* a match straddling the previous bytes and these: search tail + the first k bytes */
    char joint[2 * MAX_EXPECT];
    size_t head = n < k ? n : k;
    memcpy(joint, c->tail, c->tail_len);
    memcpy(joint + c->tail_len, p, head);
    if (memmem(joint, c->tail_len + head, G.expect, G.expect_len) ||
        memmem(p, n, G.expect, G.expect_len)) {
        c->found = 1;
        return;
    }
    /* keep the last k bytes of (tail + p) as the new tail */
    if (n >= k) {
        memcpy(c->tail, p + n - k, k);
        c->tail_len = k;
    } else {
        size_t keep = c->tail_len + n > k ? k - n : c->tail_len;
        memmove(c->tail, c->tail + c->tail_len - keep, keep);
        memcpy(c->tail + keep, p, n);
        c->tail_len = keep + n;
    }
}

/* Does header line [p, p+n) name `name` (case-insensitive, ends with ':')? Value in *v. */
static int header_is(const char *p, size_t n, const char *name, const char **v, size_t *vn) {
    size_t k = strlen(name);
    if (n <= k || strncasecmp(p, name, k) != 0 || p[k] != ':') return 0;
    const char *s = p + k + 1, *e = p + n;
    while (s < e && (*s == ' ' || *s == '\t')) s++;
    *v = s;
    *vn = (size_t)(e - s);
    return 1;
}

static int contains_ci(const char *v, size_t n, const char *word) {
    size_t k = strlen(word);
    for (size_t i = 0; i + k <= n; i++)
        if (strncasecmp(v + i, word, k) == 0) return 1;
    return 0;
}

/* Parse a response head (status line + headers, ending with the empty line) and choose
 * how its body is framed. Returns -1 when it is not HTTP/1.x. */
static int parse_head(conn_t *c, const char *p, size_t n) {
    if (n < 12 || memcmp(p, "HTTP/1.", 7) != 0) return -1;
    c->status = atoi(p + 9);
    if (c->status < 100 || c->status > 999) return -1;
    c->close_after = p[7] == '0'; /* HTTP/1.0: close unless it says keep-alive */
    int chunked = 0;
    int64_t length = -1;
    const char *line = memchr(p, '\n', n);
    const char *end = p + n;
    while (line && line + 1 < end) {
        const char *s = line + 1;
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        if (!nl) break;
        size_t len = (size_t)(nl - s);
        if (len && s[len - 1] == '\r') len--;
        const char *v;
        size_t vn;
        if (header_is(s, len, "content-length", &v, &vn)) {
            length = strtoll(v, NULL, 10);
        } else if (header_is(s, len, "transfer-encoding", &v, &vn)) {
            chunked = contains_ci(v, vn, "chunked");
        } else if (header_is(s, len, "connection", &v, &vn)) {
            if (contains_ci(v, vn, "close")) c->close_after = 1;
            if (contains_ci(v, vn, "keep-alive")) c->close_after = 0;
        }
        line = nl;
    }
    if (c->status < 200 || c->status == 204 || c->status == 304) {
        c->ps = P_LEN; /* no body */
        c->remaining = 0;
    } else if (chunked) {
        c->ps = P_CHUNK_SIZE;
    } else if (length >= 0) {
        c->ps = P_LEN;
        c->remaining = length;
    } else {
        c->ps = P_EOF;
        c->close_after = 1;
    }
    return 0;
}

/* Consume what is buffered on `c`. Returns 1 when the response is complete, 0 when more
 * bytes are needed, -1 on a protocol error. */
static int parse(conn_t *c) {
    size_t pos = 0;
    for (;;) {
        char *p = c->buf + pos;
        size_t avail = c->blen - pos;
        switch (c->ps) {
        case P_HEAD: {
            char *e = memmem(p, avail, "\r\n\r\n", 4);
            if (!e) {
                if (c->blen == BUFSZ) return -1; /* a head larger than the buffer */
                goto more;
            }
            size_t hl = (size_t)(e + 4 - p);
            if (parse_head(c, p, hl) < 0) return -1;
            pos += hl;
            if (c->status < 200) c->ps = P_HEAD; /* 1xx: the real response follows */
            break;
        }
        case P_LEN: {
            size_t take = avail < (uint64_t)c->remaining ? avail : (size_t)c->remaining;
            body_bytes(c, p, take);
            pos += take;
            c->remaining -= (int64_t)take;
            if (c->remaining == 0) goto complete;
            goto more;
        }
        case P_CHUNK_SIZE: {
            char *nl = memchr(p, '\n', avail);
            if (!nl) {
                if (avail > 1024) return -1;
                goto more;
            }
            char *endp;
            long long size = strtoll(p, &endp, 16);
            if (endp == p || size < 0) return -1;
            pos += (size_t)(nl + 1 - p);
            c->remaining = size;
            c->ps = size == 0 ? P_TRAILER : P_CHUNK_DATA;
            break;
        }
        case P_CHUNK_DATA: {
            size_t take = avail < (uint64_t)c->remaining ? avail : (size_t)c->remaining;
            body_bytes(c, p, take);
            pos += take;
            c->remaining -= (int64_t)take;
            if (c->remaining > 0) goto more;
            c->ps = P_CHUNK_CRLF;
            break;
        }
        case P_CHUNK_CRLF:
            if (avail < 2) goto more;
            if (p[0] != '\r' || p[1] != '\n') return -1;
            pos += 2;
            c->ps = P_CHUNK_SIZE;
            break;
        case P_TRAILER: {
            char *nl = memchr(p, '\n', avail);
            if (!nl) goto more;
            size_t len = (size_t)(nl - p);
            pos += len + 1;
            if (len == 0 || (len == 1 && p[0] == '\r')) goto complete;
            break; /* a trailer header: skip it */
        }
        case P_EOF:
            body_bytes(c, p, avail);
            pos += avail;
            goto more;
        }
    }
more:
    memmove(c->buf, c->buf + pos, c->blen - pos);
    c->blen -= pos;
    return 0;
complete:
    c->blen = 0; /* nothing may follow a response we did not ask for */
    return 1;
}

static void dispatch(int64_t now);

/* The response on `c` is complete: record it, then reuse or reopen the connection. */
static void conn_done(conn_t *c) {
    int64_t done = now_ns();
    int status_ok = c->status >= 200 && c->status < 300;
    if (!status_ok) {
        G.errors[E_STATUS]++;
    } else if (!c->found) {
        G.errors[E_BODY]++;
    }
    record(c->intended, c->sent, c->first_byte, done, c->status, status_ok && c->found);
    if (c->close_after) {
        c->state = C_DOWN; /* not idle: conn_reset must not look for it in the idle stack */
        conn_reset(c);
    } else {
        push_idle(c);
    }
    dispatch(done);
}

static void conn_readable(conn_t *c) {
    for (;;) {
        if (c->blen == BUFSZ) { /* parse() left a full buffer: an oversized head */
            conn_fail(c, E_PARSE);
            return;
        }
        ssize_t n = recv(c->fd, c->buf + c->blen, BUFSZ - c->blen, 0);
        if (n > 0) {
            if (c->state != C_BUSY) { /* bytes nobody asked for: drop the connection */
                conn_reset(c);
                return;
            }
            if (!c->first_byte) c->first_byte = now_ns();
            c->blen += (size_t)n;
            int r = parse(c);
            if (r < 0) {
                conn_fail(c, E_PARSE);
                return;
            }
            if (r > 0) {
                conn_done(c);
                return;
            }
        } else if (n == 0) { /* the server closed */
            if (c->state == C_BUSY && c->ps == P_EOF) {
                conn_done(c); /* close-delimited body: this was its end */
            } else if (c->state == C_BUSY) {
                conn_fail(c, E_CLOSED);
            } else {
                conn_reset(c); /* an idle keep-alive connection closed: no request lost */
            }
            return;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return;
        } else if (errno != EINTR) {
            if (c->state == C_BUSY) {
                conn_fail(c, E_READ);
            } else {
                conn_reset(c);
            }
            return;
        }
    }
}

static void conn_event(conn_t *c, uint32_t ev) {
    if (c->state == C_CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            close(c->fd);
            c->fd = -1;
            c->state = C_DOWN;
            c->retry_at = now_ns() + NS / 100; /* try again in 10 ms */
            G.errors[E_CONNECT]++;
            return;
        }
        ep_set(c, EPOLLIN, EPOLL_CTL_MOD);
        push_idle(c);
        dispatch(now_ns());
        return;
    }
    uint32_t gen = c->gen;
    if ((ev & EPOLLOUT) && c->state == C_BUSY && c->wpos < G.req_len) {
        conn_write(c);
        if (c->gen != gen) return; /* the write failed and the connection was replaced */
        if (c->state == C_BUSY && c->wpos == G.req_len) ep_set(c, EPOLLIN, EPOLL_CTL_MOD);
    }
    if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) conn_readable(c);
}

/* One epoll event: the timer (just drain it), or a connection's, unless that socket has
 * been closed (and maybe replaced) since the event was queued. */
#define TIMER_TAG UINT64_MAX
static void on_event(const struct epoll_event *e) {
    if (e->data.u64 == TIMER_TAG) {
        uint64_t expirations;
        ssize_t r = read(G.tfd, &expirations, sizeof expirations);
        (void)r;
        return;
    }
    conn_t *c = &G.conns[(uint32_t)e->data.u64];
    if ((uint32_t)(e->data.u64 >> 32) != c->gen || c->fd < 0) return;
    conn_event(c, e->events);
}

/* ------------------------------------------------------------------ the schedule */

/* When request i of the schedule is due. */
static int64_t intended_at(int64_t i) {
    return G.t0 + (int64_t)((double)i * (double)NS / G.rate);
}

/* Hand due requests to idle connections. */
static void dispatch(int64_t now) {
    if (G.rate <= 0) { /* closed loop: every idle connection sends again at once */
        while (G.sending && G.nidle > 0) {
            if (now >= G.end_sched) {
                G.sending = 0;
                break;
            }
            conn_send(&G.conns[G.idle[--G.nidle]], now);
        }
        return;
    }
    /* requests that waited for a connection longer than the timeout are given up */
    while (G.next < G.total && now - intended_at(G.next) > (int64_t)(G.timeout * NS)) {
        fail(E_TIMEOUT, intended_at(G.next), 0, 0, 0);
        G.next++;
    }
    while (G.nidle > 0 && G.next < G.total && intended_at(G.next) <= now) {
        conn_send(&G.conns[G.idle[--G.nidle]], intended_at(G.next));
        G.next++;
    }
    /* how many due requests are still waiting (all connections busy) */
    int64_t due = (int64_t)floor((double)(now - G.t0) * G.rate / (double)NS) + 1;
    if (due > G.total) due = G.total;
    if (due - G.next > G.queued_max) G.queued_max = due - G.next;
}

/* Arm the timer for the next thing to do: the next request due (if a connection is free
 * to take it), else a housekeeping tick (timeouts, reconnects) within 20 ms. */
static void arm_timer(int64_t now) {
    int64_t at = now + NS / 50;
    if (G.rate > 0 && G.nidle > 0 && G.next < G.total) {
        int64_t due = intended_at(G.next);
        if (due < at) at = due;
    }
    if (at <= now) at = now + 1000; /* due already: wake (almost) at once */
    struct itimerspec its = {0};
    its.it_value.tv_sec = at / NS;
    its.it_value.tv_nsec = at % NS;
    timerfd_settime(G.tfd, TFD_TIMER_ABSTIME, &its, NULL);
}

/* Timeouts of requests in flight, and reconnects of connections that failed to connect. */
static void housekeeping(int64_t now) {
    for (int i = 0; i < G.nconns; i++) {
        conn_t *c = &G.conns[i];
        if (c->state == C_BUSY && now - c->intended > (int64_t)(G.timeout * NS))
            conn_fail(c, E_TIMEOUT);
        else if (c->state == C_DOWN && c->retry_at && now >= c->retry_at)
            conn_open(c);
    }
}

static int busy_count(void) {
    int n = 0;
    for (int i = 0; i < G.nconns; i++) n += G.conns[i].state == C_BUSY;
    return n;
}

/* ------------------------------------------------------------------ setup */

static void parse_url(const char *url) {
    if (strncmp(url, "http://", 7) != 0) die("--url must start with http:// (no TLS)");
    const char *h = url + 7;
    const char *slash = strchr(h, '/');
    size_t hostport = slash ? (size_t)(slash - h) : strlen(h);
    snprintf(G.path, sizeof G.path, "%s", slash ? slash : "/");
    char hp[sizeof G.host];
    if (hostport == 0 || hostport >= sizeof hp) die("--url has no host");
    memcpy(hp, h, hostport);
    hp[hostport] = 0;
    char *colon = strrchr(hp, ':');
    if (colon) {
        *colon = 0;
        snprintf(G.port, sizeof G.port, "%s", colon + 1);
    } else {
        snprintf(G.port, sizeof G.port, "80");
    }
    snprintf(G.host, sizeof G.host, "%s", hp);
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open --body file");
    struct stat st;
    if (fstat(fileno(f), &st) < 0) die("cannot stat --body file");
    char *buf = xrealloc(NULL, (size_t)st.st_size + 1);
    *len = fread(buf, 1, (size_t)st.st_size, f);
    fclose(f);
    return buf;
}

/* The request is the same every time: build its bytes once. */
static void build_request(void) {
    size_t body_len = 0;
    char *body = G.body_file ? read_file(G.body_file, &body_len) : NULL;
    size_t cap = 4096 + strlen(G.path) + body_len;
    for (int i = 0; i < G.nheaders; i++) cap += strlen(G.headers[i]) + 2;
    G.req = xrealloc(NULL, cap);
    int n = snprintf(G.req, cap, "%s %s HTTP/1.1\r\nHost: %s:%s\r\n", body ? "POST" : "GET",
                     G.path, G.host, G.port);
    if (body)
        n += snprintf(G.req + n, cap - (size_t)n,
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n", body_len);
    for (int i = 0; i < G.nheaders; i++)
        n += snprintf(G.req + n, cap - (size_t)n, "%s\r\n", G.headers[i]);
    n += snprintf(G.req + n, cap - (size_t)n, "\r\n");
    if (body) {
        memcpy(G.req + n, body, body_len);
        n += (int)body_len;
        free(body);
    }
    G.req_len = (size_t)n;
}

static void usage(void) {
    fprintf(stderr,
            "usage: openloop --url http://HOST:PORT/PATH [--rate R] [--connections N]\n"
            "                [--duration S] [--body FILE] [--header 'K: V']... [--timeout S]\n"
            "                [--expect STR] [--label L] [--samples FILE]\n"
            "  --rate R      requests per second on a fixed schedule; 0 = closed loop\n"
            "  --body FILE   POST this JSON body (without: GET)\n"
            "  --expect STR  a 2xx response is ok only if its body contains STR\n"
            "  --samples F   write one line per request: intended_ms latency_ms ttfb_ms\n"
            "                lag_ms status ok (times from t0 / from the intended send)\n");
    exit(2);
}

static void parse_args(int argc, char **argv) {
    static const struct option opts[] = {
        {"url", required_argument, 0, 'u'},     {"rate", required_argument, 0, 'r'},
        {"connections", required_argument, 0, 'c'},
        {"duration", required_argument, 0, 'd'}, {"body", required_argument, 0, 'b'},
        {"header", required_argument, 0, 'H'},  {"timeout", required_argument, 0, 't'},
        {"expect", required_argument, 0, 'e'},  {"label", required_argument, 0, 'l'},
        {"samples", required_argument, 0, 's'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *url = NULL;
    G.rate = 0;
    G.nconns = 16;
    G.duration = 10;
    G.timeout = 10;
    G.label = "";
    int o;
    while ((o = getopt_long(argc, argv, "u:r:c:d:b:H:t:e:l:s:h", opts, NULL)) != -1) {
        switch (o) {
        case 'u': url = optarg; break;
        case 'r': G.rate = atof(optarg); break;
        case 'c': G.nconns = atoi(optarg); break;
        case 'd': G.duration = atof(optarg); break;
        case 'b': G.body_file = optarg; break;
        case 'H':
            if (G.nheaders == MAX_HEADERS) die("too many --header");
            G.headers[G.nheaders++] = optarg;
            break;
        case 't': G.timeout = atof(optarg); break;
        case 'e':
            if (strlen(optarg) == 0 || strlen(optarg) >= MAX_EXPECT) die("--expect: 1-255 bytes");
            snprintf(G.expect, sizeof G.expect, "%s", optarg);
            G.expect_len = strlen(optarg);
            break;
        case 'l': G.label = optarg; break;
        case 's': G.samples_file = optarg; break;
        default: usage();
        }
    }
    if (!url) usage();
    if (G.rate < 0 || G.nconns < 1 || G.nconns > 100000 || G.duration <= 0 || G.timeout <= 0)
        die("--rate >= 0, --connections >= 1, --duration > 0 and --timeout > 0 please");
    parse_url(url);
}

/* ------------------------------------------------------------------ report */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile q (0..1) of sorted v[0..n), in ms. */
static double pct(const int64_t *v, size_t n, double q) {
    if (n == 0) return 0;
    size_t k = (size_t)ceil(q * (double)n);
    if (k < 1) k = 1;
    return (double)v[k - 1] / 1e6;
}

/* Print "name": {p50, p90, p99, p999, max, mean} of one field of the ok samples. */
static void print_dist(const char *name, size_t field_off) {
    int64_t *v = xrealloc(NULL, (G.nsamples + 1) * sizeof(int64_t));
    size_t n = 0;
    double sum = 0;
    for (size_t i = 0; i < G.nsamples; i++) {
        int64_t x = *(const int64_t *)((const char *)&G.samples[i] + field_off);
        if (!G.samples[i].ok || x < 0) continue;
        v[n++] = x;
        sum += (double)x;
    }
    qsort(v, n, sizeof *v, cmp_i64);
    printf("\"%s\": {\"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f, \"p999\": %.3f, "
           "\"max\": %.3f, \"mean\": %.3f}",
           name, pct(v, n, 0.5), pct(v, n, 0.9), pct(v, n, 0.99), pct(v, n, 0.999),
           n ? (double)v[n - 1] / 1e6 : 0.0, n ? sum / (double)n / 1e6 : 0.0);
    free(v);
}

static void json_str(const char *s) {
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') putchar('\\');
        if ((unsigned char)*s >= 0x20) putchar(*s);
    }
    putchar('"');
}

static void report(int64_t t_end) {
    int64_t errors = 0;
    for (int k = 0; k < E_KINDS; k++) errors += G.errors[k];
    double window = (double)(G.end_sched - G.t0) / 1e9;
    printf("{\"tool\": \"openloop\", \"label\": ");
    json_str(G.label);
    printf(", \"mode\": \"%s\", \"rate\": %.3f, \"connections\": %d, \"duration_s\": %.3f, ",
           G.rate > 0 ? "open" : "closed", G.rate, G.nconns, window);
    printf("\"scheduled\": %lld, \"sent\": %lld, \"requests\": %zu, \"ok\": %lld, "
           "\"errors\": %lld, \"errors_by\": {",
           (long long)(G.rate > 0 ? G.total : G.sent), (long long)G.sent, G.nsamples,
           (long long)G.ok, (long long)errors);
    for (int k = 0; k < E_KINDS; k++)
        printf("%s\"%s\": %lld", k ? ", " : "", ERR_NAMES[k], (long long)G.errors[k]);
    /* rps: ok responses completed inside the schedule window / the window; a server that
     * cannot keep up shows here as a rate below the one asked for */
    printf("}, \"rps\": %.1f, \"wall_s\": %.3f, \"queued_max\": %lld, ",
           (double)G.ok_in_window / window, (double)(t_end - G.t0) / 1e9,
           (long long)G.queued_max);
    print_dist("lat_ms", offsetof(sample_t, latency));
    printf(", ");
    print_dist("ttfb_ms", offsetof(sample_t, ttfb));
    printf(", ");
    print_dist("send_lag_ms", offsetof(sample_t, lag));
    printf("}\n");
    fflush(stdout);
    if (G.samples_file) {
        FILE *f = fopen(G.samples_file, "w");
        if (!f) die("cannot write --samples file");
        for (size_t i = 0; i < G.nsamples; i++) {
            sample_t *s = &G.samples[i];
            fprintf(f, "%.3f %.3f %.3f %.3f %d %d\n", (double)s->intended / 1e6,
                    (double)s->latency / 1e6, s->ttfb < 0 ? -1.0 : (double)s->ttfb / 1e6,
                    s->lag < 0 ? -1.0 : (double)s->lag / 1e6, s->status, s->ok);
        }
        fclose(f);
    }
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
    parse_args(argc, argv);
    signal(SIGPIPE, SIG_IGN);
    build_request();
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    if (getaddrinfo(G.host, G.port, &hints, &G.addr) != 0) die("cannot resolve the --url host");

    G.ep = epoll_create1(EPOLL_CLOEXEC);
    G.tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (G.ep < 0 || G.tfd < 0) die("epoll/timerfd unavailable");
    struct epoll_event tev = {.events = EPOLLIN, .data.u64 = TIMER_TAG};
    epoll_ctl(G.ep, EPOLL_CTL_ADD, G.tfd, &tev);
    G.conns = calloc((size_t)G.nconns, sizeof(conn_t));
    G.idle = calloc((size_t)G.nconns, sizeof(int));
    if (!G.conns || !G.idle) die("out of memory");

    /* Open every connection before t0 (up to 5 s), so the schedule does not start with
     * N handshakes in its first milliseconds. */
    for (int i = 0; i < G.nconns; i++) {
        G.conns[i].fd = -1;
        conn_open(&G.conns[i]);
    }
    struct epoll_event evs[256];
    int64_t open_deadline = now_ns() + 5 * NS;
    while (G.nidle < G.nconns && now_ns() < open_deadline) {
        int n = epoll_wait(G.ep, evs, 256, 50);
        for (int i = 0; i < n; i++) on_event(&evs[i]);
        for (int i = 0; i < G.nconns; i++)
            if (G.conns[i].state == C_DOWN && now_ns() >= G.conns[i].retry_at)
                conn_open(&G.conns[i]);
    }
    if (G.nidle == 0) {
        fprintf(stderr, "openloop: no connection to %s:%s could be opened\n", G.host, G.port);
    }
    int64_t connect_errors_before_t0 = G.errors[E_CONNECT];
    G.errors[E_CONNECT] = 0; /* a refused connect before t0 costs no request */

    G.t0 = now_ns();
    G.end_sched = G.t0 + (int64_t)(G.duration * NS);
    G.total = G.rate > 0 ? (int64_t)floor(G.duration * G.rate) : 0;
    G.sending = 1;
    int64_t hard_end = G.end_sched + (int64_t)(G.timeout * NS) + NS;
    dispatch(G.t0);
    int64_t now = G.t0, last_hk = G.t0;
    for (;;) {
        arm_timer(now);
        int n = epoll_wait(G.ep, evs, 256, 100);
        if (n < 0 && errno != EINTR) die("epoll_wait failed");
        for (int i = 0; i < n; i++) on_event(&evs[i]);
        now = now_ns();
        if (now - last_hk >= NS / 100) { /* every 10 ms: timeouts and reconnects */
            housekeeping(now);
            last_hk = now;
        }
        dispatch(now);
        int finished_sending = G.rate > 0 ? G.next >= G.total : !G.sending || now >= G.end_sched;
        if (G.rate <= 0 && now >= G.end_sched) G.sending = 0;
        if (finished_sending && busy_count() == 0) break;
        if (now >= hard_end) { /* whatever is still in flight has timed out */
            for (int i = 0; i < G.nconns; i++)
                if (G.conns[i].state == C_BUSY) conn_fail(&G.conns[i], E_TIMEOUT);
            while (G.rate > 0 && G.next < G.total) {
                fail(E_TIMEOUT, intended_at(G.next), 0, 0, 0);
                G.next++;
            }
            break;
        }
    }
    report(now_ns());
    if (connect_errors_before_t0)
        fprintf(stderr, "openloop: %lld connect attempts failed before the run started\n",
                (long long)connect_errors_before_t0);
    return 0;
}
