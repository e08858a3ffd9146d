/* A tick's rows drawn (or their argmaxes taken) on llama.cpp's own OpenMP threads.
 *
 * Why: on a CPU, llama.cpp runs llama_decode on OpenMP threads (GNU libgomp), one per core,
 * which keep spinning for a few milliseconds after the decode, waiting for the next job
 * (worker/openmp.py). A Python helper thread that samples right after the decode must first
 * be woken (~250 us on this project's VM) and then share a core with a spinning thread. Handed
 * to libgomp instead, the rows go to those same threads, already awake: on this project's two
 * cores a 16-row tick's host work fell from 2.4 to 1.6 ms (greedy) and from 3.7 to 2.3 ms
 * (T 0.7 + top_p 0.95), a 4-row tick's from 1.5 to 1.2 (docs/sampling.md).
 *
 * libgomp is not linked in: where llama.cpp loaded it, it is in the process already, and its
 * GOMP_parallel is found there (dlopen with RTLD_NOLOAD); a parallel region started from the
 * thread that calls llama_decode gets that thread's pool. Where it is not loaded (a build of
 * llama.cpp without OpenMP), ls_openmp says so and the caller uses its own threads. The
 * tokens never depend on the thread count: each row has its own seed.
 */

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>

/* rowdraw.c's and rowscan.c's */
void ls_draw_group(const float *const *rows, int64_t count, int64_t n, const double *settings,
                   const uint64_t *seeds, char *scratch, int64_t *tokens, double *found);
void ls_argmax_rows(const float *rows, int64_t count, int64_t n, float *block_max,
                    int64_t *out);

/* rowscan.c's ROWS_AT_ONCE: the most rows ls_argmax_rows and ls_draw_group take in a call. */
#define ROWS_AT_ONCE 4

typedef void (*Parallel)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
static Parallel gomp_parallel;
static int (*omp_thread_num)(void);

/* 1 where libgomp is loaded in this process (llama.cpp's CPU backend loads it), so that
 * ls_draw_rows_on and ls_argmax_rows_on run on its threads; 0 otherwise. */
int ls_openmp(void) {
    if (gomp_parallel) return 1;
    void *gomp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!gomp) return 0;
    Parallel parallel = (Parallel)dlsym(gomp, "GOMP_parallel");
    int (*thread_num)(void) = (int (*)(void))dlsym(gomp, "omp_get_thread_num");
    if (!parallel || !thread_num) return 0;
    omp_thread_num = thread_num;
    gomp_parallel = parallel;
    return 1;
}

/* fn(job) on `threads` threads (this one among them), no more than there are rows; or on
 * this thread alone. */
static void run(void (*fn)(void *), void *job, int threads, int64_t rows) {
    if (rows < threads) threads = (int)rows;
    if (threads > 1 && ls_openmp()) gomp_parallel(fn, job, (unsigned)threads, 0);
    else fn(job);
}

/* Counts a thread into a job's team (what the two functions below return, for the tests). */
static void join(atomic_int *team) {
    atomic_fetch_add(team, 1);
}

static int thread_index(void) {
    return omp_thread_num ? omp_thread_num() : 0;
}

typedef struct {
    const float *logits;
    int64_t n, count;
    const int64_t *rows;
    const double *settings;
    const uint64_t *seeds;
    char *scratch;
    int64_t scratch_stride;
    int64_t *tokens;
    double *found;
    int64_t group;     /* rows a thread takes at once */
    atomic_llong next; /* the next row to take: the threads share the rows out as they go */
    atomic_int team;   /* how many threads took part */
} DrawJob;

static void draw_some(void *arg) {
    DrawJob *job = arg;
    join(&job->team);
    char *scratch = job->scratch + job->scratch_stride * thread_index();
    for (int64_t i; (i = atomic_fetch_add(&job->next, job->group)) < job->count;) {
        int64_t count = job->count - i < job->group ? job->count - i : job->group;
        const float *rows[ROWS_AT_ONCE] = {0};
        for (int64_t k = 0; k < count; k++) rows[k] = job->logits + job->rows[i + k] * job->n;
        ls_draw_group(rows, count, job->n, job->settings + 5 * i, job->seeds + i, scratch,
                      job->tokens + i, job->found + 2 * i);
    }
}

/* How many rows a thread takes at once: up to ROWS_AT_ONCE, no more than its share, so that
 * every thread has rows. */
static int64_t group_of(int64_t rows, int threads) {
    int64_t share = threads > 1 ? rows / threads : rows;
    return share < 1 ? 1 : share > ROWS_AT_ONCE ? ROWS_AT_ONCE : share;
}

/* ls_draw for count rows of one tick's logits (rows of n floats each, one after another),
 * on `threads` threads: tokens[i] is drawn from row rows[i] with settings[5 i ...]
 * (temperature, top_k, top_p, min_p, span) and seeds[i], and found[2 i], found[2 i + 1] get
 * what ls_draw's found does; each thread takes a group of rows at a time (group_of:
 * ls_draw_group reads their maxima side by side). scratch holds one ls_draw_scratch_bytes(n)
 * room per thread, scratch_stride bytes apart (each 64-byte aligned). One call for a tick's
 * rows, where a call a row took the GIL back after every row: on an H100 machine's 16 cores,
 * 8 or 16 Python threads that did so drew a tick's rows more slowly than 4 (docs/gpu.md).
 * Returns how many threads took part. */
int ls_draw_rows_on(const float *logits, int64_t n, int64_t count, const int64_t *rows,
                     const double *settings, const uint64_t *seeds, char *scratch,
                     int64_t scratch_stride, int threads, int64_t *tokens, double *found) {
    DrawJob job = {.logits = logits, .n = n, .count = count, .rows = rows, .settings = settings,
                   .seeds = seeds, .scratch = scratch, .scratch_stride = scratch_stride,
                   .tokens = tokens, .found = found, .group = group_of(count, threads)};
    atomic_init(&job.next, 0);
    atomic_init(&job.team, 0);
    run(draw_some, &job, threads, count);
    return atomic_load(&job.team);
}

typedef struct {
    const float *rows;
    int64_t n_rows, n;
    float *block_max;
    int64_t block_stride;
    int64_t *out;
    int64_t group; /* rows a thread takes at once */
    atomic_llong next;
    atomic_int team;
} ArgmaxJob;

static void argmax_some(void *arg) {
    ArgmaxJob *job = arg;
    join(&job->team);
    float *block_max = job->block_max + job->block_stride * thread_index();
    for (int64_t r; (r = atomic_fetch_add(&job->next, job->group)) < job->n_rows;) {
        int64_t count = job->n_rows - r < job->group ? job->n_rows - r : job->group;
        ls_argmax_rows(job->rows + r * job->n, count, job->n, block_max, job->out + r);
    }
}

/* ls_argmax of each of n_rows rows of n logits (one after another in memory) into out, on
 * `threads` threads, each taking a group of rows at a time (group_of): block_max holds
 * ls_argmax_scratch_floats(n) floats per thread, block_stride floats apart. Returns how many
 * threads took part. */
int ls_argmax_rows_on(const float *rows, int64_t n_rows, int64_t n, float *block_max,
                       int64_t block_stride, int threads, int64_t *out) {
    ArgmaxJob job = {.rows = rows, .n_rows = n_rows, .n = n, .block_max = block_max,
                     .block_stride = block_stride, .out = out, .group = group_of(n_rows, threads)};
    atomic_init(&job.next, 0);
    atomic_init(&job.team, 0);
    run(argmax_some, &job, threads, n_rows);
    return atomic_load(&job.team);
}
