/* kvstrata.impl._native, part: the Hasher type (kvstrata.impl.hashing.BackgroundHasher's C thread). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_native.h"

/* ------------------------------------------------------------------------------------------------
 * Hasher: a C worker thread that hashes chains queued by submit(), never touching Python objects, so
 * the scheduler thread never waits on the GIL for it. Jobs finish in submission order; done() counts
 * them. A job reads its tokens from the arena (a writable buffer held from construction to dealloc;
 * submit copies them there) or in place, reads its seed from its own copy or from an earlier job's
 * output, and writes its digests to an output buffer. A job holds a reference to every object it
 * reads or writes outside the arena until it finished (released by the next call that holds the
 * GIL); the owner (kvstrata.impl.hashing.BackgroundHasher) reuses an arena region only after the job
 * in it finished.
 */
typedef struct HashTask {
    struct HashTask *next;
    Py_ssize_t data, pages;      /* arena offset of the copied tokens (or -1: `source`) */
    const unsigned char *source; /* the caller's tokens when not copied */
    unsigned char *out;          /* the caller's output buffer, 32 bytes per page */
    const unsigned char *seed_at; /* a 32-byte seed in an earlier job's output, or NULL: `seed` */
    size_t seed_len;
    unsigned char seed[DIGEST];
    PyObject *keep[3]; /* out, in-place tokens, the seed's buffer: alive until released */
} HashTask;

typedef struct {
    PyObject_HEAD
    Py_buffer arena;
    Py_ssize_t page_bytes;
    pthread_mutex_t lock;
    pthread_cond_t work; /* signalled on submit, resume and close */
    pthread_cond_t progress; /* signalled when a job finishes and when the thread exits */
    HashTask *head, *tail;
    HashTask *finished; /* done, references not yet released (that needs the GIL) */
    long long submitted, done, busy_ns;
    long long limit; /* jobs with seq < limit may run (LLONG_MAX unless paused by a test) */
    int running, closing, initialised;
    int sleeping; /* the thread waits on `work` (not polling): submit must signal it */
    unsigned long forks; /* `fork_count` when the thread state was last valid in this process */
} Hasher;

/* Forks of this process so far, bumped in the child by a pthread_atfork handler (installed once at
 * import). A child inherits a Hasher whose thread did not survive the fork and whose lock may be
 * held by it: the first call in the child sees the count changed and starts afresh (new lock,
 * conditions and thread; the queued jobs and their buffers were copied with the process). */
static unsigned long fork_count = 0;

static void count_fork_in_child(void) { fork_count++; }

/* Idle, the thread first polls the queue every POLL_NS for POLL_ROUNDS rounds, then sleeps on
 * `work` for up to a second and exits. While it polls, submit does not signal: waking a sleeping
 * thread on another CPU costs the submitting thread a futex call and, in a VM, an inter-processor
 * interrupt (measured: ~15 us per submit, a quarter of the whole scheduler path). */
#define POLL_NS 100000L
#define POLL_ROUNDS 2000

static void *hasher_main(void *arg) {
    Hasher *self = arg;
    unsigned char *arena = self->arena.buf;
    int polls = 0;
    pthread_mutex_lock(&self->lock);
    for (;;) {
        while ((self->head == NULL || self->done >= self->limit) && !self->closing) {
            if (polls < POLL_ROUNDS) {
                struct timespec pause = {0, POLL_NS};
                polls++;
                pthread_mutex_unlock(&self->lock);
                nanosleep(&pause, NULL);
                pthread_mutex_lock(&self->lock);
                continue;
            }
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            self->sleeping = 1;
            int waited = pthread_cond_timedwait(&self->work, &self->lock, &until);
            self->sleeping = 0;
            if (waited == ETIMEDOUT && self->head == NULL)
                goto out; /* idle for a second: exit; the next submit starts a new thread */
        }
        polls = 0;
        if (self->head == NULL) goto out;
        HashTask *task = self->head;
        pthread_mutex_unlock(&self->lock);
        const unsigned char *seed = task->seed_at != NULL ? task->seed_at : task->seed;
        size_t seed_len = task->seed_at != NULL ? DIGEST : task->seed_len;
        struct timespec started, finished;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &started);
        native_chain(seed, seed_len, task->source != NULL ? task->source : arena + task->data, task->pages,
              self->page_bytes, task->out);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &finished);
        pthread_mutex_lock(&self->lock);
        self->busy_ns += (finished.tv_sec - started.tv_sec) * 1000000000LL +
                         (finished.tv_nsec - started.tv_nsec);
        self->head = task->next;
        if (self->head == NULL) self->tail = NULL;
        task->next = self->finished;
        self->finished = task;
        self->done++;
        pthread_cond_broadcast(&self->progress);
    }
out:
    self->running = 0;
    pthread_cond_broadcast(&self->progress);
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static int hasher_start(Hasher *self) { /* lock held */
    pthread_attr_t attr;
    pthread_t thread;
    if (pthread_attr_init(&attr)) return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, hasher_main, self);
    pthread_attr_destroy(&attr);
    if (failed) return -1;
    self->running = 1;
    return 0;
}

static int Hasher_init(Hasher *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"arena", "page_bytes", NULL};
    PyObject *arena;
    Py_ssize_t page_bytes;
    if (self->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", names, &arena, &page_bytes)) return -1;
    if (native_check_page_bytes(page_bytes) < 0) return -1;
    if (PyObject_GetBuffer(arena, &self->arena, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->page_bytes = page_bytes;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->progress, NULL);
    self->limit = LLONG_MAX;
    self->forks = fork_count;
    self->initialised = 1;
    return 0;
}

static int hasher_ready(Hasher *self) {
    if (!self->initialised) {
        PyErr_SetString(PyExc_RuntimeError, "Hasher is not initialised");
        return -1;
    }
    if (self->forks != fork_count) { /* the first call in a forked child (see fork_count) */
        pthread_mutex_init(&self->lock, NULL);
        pthread_cond_init(&self->work, NULL);
        pthread_cond_init(&self->progress, NULL);
        self->running = 0;
        self->sleeping = 0;
        self->forks = fork_count;
    }
    return 0;
}

static void release_tasks(HashTask *task) { /* GIL held */
    while (task != NULL) {
        HashTask *next = task->next;
        for (int i = 0; i < 3; i++) Py_XDECREF(task->keep[i]);
        free(task);
        task = next;
    }
}

/* Drop the references finished jobs held (GIL held). */
static void release_finished(Hasher *self) {
    pthread_mutex_lock(&self->lock);
    HashTask *finished = self->finished;
    self->finished = NULL;
    pthread_mutex_unlock(&self->lock);
    release_tasks(finished);
}

/* Stop accepting work, finish the queue, wait for the thread (GIL released). */
static void hasher_close(Hasher *self) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    self->closing = 1;
    self->limit = LLONG_MAX;
    pthread_cond_broadcast(&self->work);
    while (self->running) pthread_cond_wait(&self->progress, &self->lock);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
}

static void Hasher_dealloc(Hasher *self) {
    if (self->initialised) {
        (void)hasher_ready(self); /* in a forked child: a fresh lock first */
        hasher_close(self);
        release_finished(self);
        release_tasks(self->head); /* only left if the thread could not start */
        self->head = self->tail = NULL;
        PyBuffer_Release(&self->arena);
        pthread_cond_destroy(&self->progress);
        pthread_cond_destroy(&self->work);
        pthread_mutex_destroy(&self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int in_arena(Hasher *self, Py_ssize_t at, Py_ssize_t size, const char *what) {
    if (at < 0 || size < 0 || at > self->arena.len - size) {
        PyErr_Format(PyExc_ValueError, "%s [%zd, %zd) lies outside the arena of %zd bytes", what,
                     at, at + size, self->arena.len);
        return -1;
    }
    return 0;
}

static PyObject *Hasher_submit(Hasher *self, PyObject *const *args, Py_ssize_t nargs) {
    if (hasher_ready(self) < 0) return NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "submit(seed, tokens, pages, data, out) takes 5 arguments");
        return NULL;
    }
    release_finished(self);
    HashTask *task = calloc(1, sizeof(HashTask));
    if (task == NULL) return PyErr_NoMemory();
    task->pages = PyLong_AsSsize_t(args[2]);
    task->data = args[3] == Py_None ? -1 : PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) goto fail;
    if (task->pages < 0) {
        PyErr_SetString(PyExc_ValueError, "pages must be >= 0");
        goto fail;
    }
    Py_buffer view;
    if (PyTuple_Check(args[0])) { /* (output buffer of an earlier job, byte offset) */
        Py_ssize_t at = -1;
        if (PyTuple_GET_SIZE(args[0]) == 2) at = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[0], 1));
        if (at == -1 && PyErr_Occurred()) goto fail;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[0], 0), &view, PyBUF_SIMPLE) < 0) goto fail;
        int inside = at >= 0 && at <= view.len - DIGEST;
        task->seed_at = (const unsigned char *)view.buf + (inside ? at : 0);
        PyBuffer_Release(&view); /* the owner keeps that buffer alive until this job finished */
        if (!inside) {
            PyErr_SetString(PyExc_ValueError, "a seed reference is (buffer, offset of 32 bytes)");
            goto fail;
        }
    } else {
        if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) goto fail;
        if (view.len != DIGEST && view.len != 0) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "seed must be 32 bytes or empty, got %zd", view.len);
            goto fail;
        }
        memcpy(task->seed, view.buf, (size_t)view.len);
        task->seed_len = (size_t)view.len;
        PyBuffer_Release(&view);
    }
    if (PyObject_GetBuffer(args[4], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
    task->out = view.buf;
    Py_ssize_t out_len = view.len;
    PyBuffer_Release(&view); /* the owner keeps it alive until this job finished */
    if (out_len < task->pages * DIGEST) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, %zd pages need %zd", out_len,
                     task->pages, task->pages * DIGEST);
        goto fail;
    }
    if (task->data >= 0 && in_arena(self, task->data, task->pages * self->page_bytes, "data") < 0)
        goto fail;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0) goto fail;
    if (view.len != task->pages * self->page_bytes) {
        PyErr_Format(PyExc_ValueError, "tokens hold %zd bytes, %zd pages need %zd", view.len,
                     task->pages, task->pages * self->page_bytes);
        PyBuffer_Release(&view);
        goto fail;
    }
    if (task->data >= 0) /* the job's own copy: the caller may change its tokens after submit */
        memcpy((unsigned char *)self->arena.buf + task->data, view.buf, (size_t)view.len);
    else /* read in place: the owner keeps `tokens` alive and unchanged until the job finished */
        task->source = view.buf;
    PyBuffer_Release(&view);
    /* what the thread reads or writes outside the arena stays alive until the job is released */
    task->keep[0] = Py_NewRef(args[4]);
    task->keep[1] = task->data < 0 ? Py_NewRef(args[1]) : NULL;
    task->keep[2] = PyTuple_Check(args[0]) ? Py_NewRef(PyTuple_GET_ITEM(args[0], 0)) : NULL;
    pthread_mutex_lock(&self->lock);
    if (self->closing) {
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_RuntimeError, "Hasher is closed");
        release_tasks(task);
        return NULL;
    }
    if (self->tail != NULL) self->tail->next = task;
    else self->head = task;
    self->tail = task;
    long long seq = self->submitted++;
    if (self->running && self->sleeping) pthread_cond_signal(&self->work);
    if (!self->running && hasher_start(self) < 0) {
        /* leave the task queued: a later submit retries the thread; report the failure now */
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_OSError, "could not start the hashing thread");
        return NULL;
    }
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(seq);
fail:
    free(task);
    return NULL;
}

static PyObject *Hasher_done(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    release_finished(self);
    pthread_mutex_lock(&self->lock);
    long long done = self->done;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(done);
}

static PyObject *Hasher_wait(Hasher *self, PyObject *arg) {
    if (hasher_ready(self) < 0) return NULL;
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int stuck = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (seq >= self->submitted) {
        stuck = 2;
    } else if (self->done <= seq) {
        if (self->limit <= seq) self->limit = seq + 1; /* a paused hasher runs what is waited on */
        pthread_cond_broadcast(&self->work);
        while (self->done <= seq) {
            if (!self->running && hasher_start(self) < 0) {
                stuck = 1;
                break;
            }
            pthread_cond_wait(&self->progress, &self->lock);
        }
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (stuck == 1) return PyErr_Format(PyExc_OSError, "could not start the hashing thread");
    if (stuck == 2) return PyErr_Format(PyExc_ValueError, "job %lld was never submitted", seq);
    release_finished(self);
    Py_RETURN_NONE;
}

static PyObject *Hasher_pause(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    if (!self->closing) self->limit = self->done;
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *hasher_allow(Hasher *self, long long limit) {
    pthread_mutex_lock(&self->lock);
    if (limit > self->limit) self->limit = limit;
    if (!self->running && self->head != NULL && hasher_start(self) < 0) {
        pthread_mutex_unlock(&self->lock);
        return PyErr_Format(PyExc_OSError, "could not start the hashing thread");
    }
    pthread_cond_broadcast(&self->work);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Hasher_resume(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    return hasher_allow(self, LLONG_MAX);
}

static PyObject *Hasher_step(Hasher *self, PyObject *arg) {
    if (hasher_ready(self) < 0) return NULL;
    long long jobs = PyLong_AsLongLong(arg);
    if (jobs == -1 && PyErr_Occurred()) return NULL;
    if (jobs < 0) return PyErr_Format(PyExc_ValueError, "step takes jobs >= 0, got %lld", jobs);
    pthread_mutex_lock(&self->lock);
    long long limit = self->limit == LLONG_MAX ? LLONG_MAX : self->limit + jobs;
    pthread_mutex_unlock(&self->lock);
    return hasher_allow(self, limit);
}

static PyObject *Hasher_close(Hasher *self, PyObject *unused) {
    (void)unused;
    if (hasher_ready(self) < 0) return NULL;
    hasher_close(self);
    release_finished(self);
    Py_RETURN_NONE;
}

static PyObject *Hasher_running(Hasher *self, void *closure) {
    (void)closure;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int running = self->running;
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(running);
}

static PyMethodDef hasher_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Hasher_submit, METH_FASTCALL,
     "submit(seed, tokens, pages, data, out, /) -> int: copy `tokens` (exactly `pages` pages) to\n"
     "arena offset `data` (None: read them in place when the job runs) and queue their chain, its\n"
     "digests written to the writable buffer `out`. `seed` is bytes (32 or empty) or a pair\n"
     "(buffer, offset): the 32 bytes there, read when the job runs (an earlier job's output). The\n"
     "caller keeps `out`, the seed buffer and in-place tokens alive and unchanged until the job\n"
     "finished. Returns the job's sequence number."},
    {"done", (PyCFunction)Hasher_done, METH_NOARGS,
     "done() -> int: how many jobs finished (jobs finish in submission order)."},
    {"wait", (PyCFunction)Hasher_wait, METH_O,
     "wait(seq, /): block (GIL released) until job `seq` finished; on a paused hasher the jobs up\n"
     "to `seq` run first."},
    {"pause", (PyCFunction)Hasher_pause, METH_NOARGS,
     "pause(): the thread starts no new job until resume(), step() or a wait() needs it (tests:\n"
     "hold jobs in flight)."},
    {"resume", (PyCFunction)Hasher_resume, METH_NOARGS, "resume(): undo pause()."},
    {"step", (PyCFunction)Hasher_step, METH_O,
     "step(jobs, /): on a paused hasher, let `jobs` more jobs run."},
    {"close", (PyCFunction)Hasher_close, METH_NOARGS,
     "close(): finish every queued job and stop the thread; later submits fail."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Hasher_busy_ns(Hasher *self, void *closure) {
    (void)closure;
    if (hasher_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    long long busy = self->busy_ns;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(busy);
}

static PyGetSetDef hasher_getset[] = {
    {"busy_ns", (getter)Hasher_busy_ns, NULL, "CPU time the thread spent hashing (ns).", NULL},
    {"running", (getter)Hasher_running, NULL, "Whether the worker thread is alive.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstrata.impl._native.Hasher",
    .tp_basicsize = sizeof(Hasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hasher(arena, page_bytes): chained SHA-256 on a C thread over one arena buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hasher_init,
    .tp_dealloc = (destructor)Hasher_dealloc,
    .tp_methods = hasher_methods,
    .tp_getset = hasher_getset,
};

int native_add_hasher(PyObject *module) {
    pthread_atfork(NULL, NULL, count_fork_in_child);
    if (PyType_Ready(&HasherType) < 0) return -1;
    Py_INCREF(&HasherType);
    if (PyModule_AddObject(module, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(&HasherType);
        return -1;
    }
    return 0;
}
