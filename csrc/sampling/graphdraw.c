/* The host sampler's draw run inside llama_decode, on llama.cpp's own threads, straight from
 * the output layer's logits (backend_sampling.py's GraphDraws; `--backend-sampling draw`).
 *
 * Why: for every pass whose rows are sampled on the host, llama.cpp copies the logits of all
 * of them out of its graph with one memcpy on one thread (262,144 floats a row on Gemma): on
 * this project's 2-core Xeon 2.6 ms of an 81 ms pass at 16 rows, 10.5 ms of 272 at 64, more
 * than the draws themselves. A sequence with a backend sampler attached has its token drawn
 * in the graph and no logits copied (llama.cpp's backend sampling); llama.cpp's own samplers
 * sort and sum the whole vocabulary there, and pad a copy of the logits first. This sampler
 * adds one custom operation a row that reads the output layer's row itself (not the padded
 * copy) and draws as rowdraw.c does on the host: the same tokens for the same seeds.
 *
 * The operation's threads share the row's block maxima (a slice each; for a top-p alone, which
 * sums the row in its scan, a share of the scan's parts, folded as the host's one pass folds
 * them: the same sums), then the first thread finishes the draw. Every row is drawn here
 * (rowdraw.c serves every row: a NaN's gives its argmax, a top-p cut in doubt is summed again
 * in float64), so no row is ever copied out for the host.
 *
 * Building a pass's graph, the sampler also runs the pass hook the worker set, if any: the
 * kernels library's ls_q0_swap_graph (csrc/kernels/q0swap.c), which swaps its matmuls for
 * loomserve's (the same numbers to the bit, sooner) where the CPU can. A pointer, not a call,
 * so that the two libraries build and load apart (the kernels are the engine's, not sampling's).
 *
 * llama.cpp's sampler structs are declared below and ggml's tensor in ggml_abi.h, as
 * llama-cpp-python 0.3.36's llama.cpp has them; ls_graph_bind checks ggml's tensor size
 * against that declaration and refuses (the worker then samples on the host) where they
 * differ.
 */

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml_abi.h"

#define BLOCK 256

/* rowscan.c's and rowdraw.c's */
int ls_block_max(const float *row, int64_t n, float *block_max);
int64_t ls_argmax_from(const float *row, int64_t n, const float *block_max, int nan);
int64_t ls_draw(const float *row, int64_t n, double temperature, int64_t top_k, double top_p,
                double min_p, double span, uint64_t seed, char *scratch, double *found);
int64_t ls_draw_from_scan(const float *row, int64_t n, const double *settings, uint64_t seed,
                          char *scratch, double total, double weighted_depth, double *found);
int ls_top_p_alone(int64_t n, int64_t top_k, double top_p);
int64_t ls_draw_parts_at(int64_t n);
int64_t ls_scan_parts(int64_t n);
int ls_scan_exp_sum_part(const float *row, int64_t n, float *block_max, int64_t part,
                         double *sums);
void ls_scan_fold(const double *sums, int64_t count, double *total, double *weighted_depth);
int ls_isa(void);
/* Run on each pass's graph as it is built (ls_graph_set_pass_hook); NULL: none. */
typedef void (*pass_hook_fn)(void *graph);
static _Atomic(pass_hook_fn) pass_hook;

struct llama_sampler_data {
    struct ggml_tensor *logits, *probs, *sampled, *candidates;
};

struct llama_sampler;

struct llama_sampler_i {
    const char *(*name)(const struct llama_sampler *);
    void (*accept)(struct llama_sampler *, int32_t);
    void (*apply)(struct llama_sampler *, void *);
    void (*reset)(struct llama_sampler *);
    struct llama_sampler *(*clone)(const struct llama_sampler *);
    void (*free)(struct llama_sampler *);
    bool (*backend_init)(struct llama_sampler *, void *, uint32_t);
    void (*backend_accept)(struct llama_sampler *, void *, void *, struct ggml_tensor *);
    void (*backend_apply)(struct llama_sampler *, void *, void *, struct llama_sampler_data *);
    void (*backend_set_input)(struct llama_sampler *);
    void (*backend_reset)(struct llama_sampler *);
    void (*copy_state)(const struct llama_sampler *, struct llama_sampler *);
};

struct llama_sampler {
    struct llama_sampler_i *iface;
    void *ctx;
};

/* One sequence's draw: written by the worker before each pass (graph_draw.py's
 * DrawState mirrors it), read back after. */
typedef struct {
    double settings[5]; /* temperature, top_k, top_p, min_p, span (ls_draw's) */
    uint64_t seed;
    int64_t greedy;     /* 1: the argmax, settings unused */
    int64_t n;          /* the row's length */
    char *scratch;      /* ls_draw_scratch_bytes(n), shared: one operation runs at a time */
    int64_t token;      /* out: the token */
    double found[2];    /* out: ls_draw's */
    atomic_int arrived; /* threads done with their slice of the block maxima */
    atomic_int nan;     /* whether a slice held a NaN */
} GraphDraw;

typedef struct ggml_tensor *(*custom_4d_fn)(void *, int, int64_t, int64_t, int64_t, int64_t,
                                             struct ggml_tensor **, int, void *, int, void *);
typedef struct ggml_tensor *(*view_1d_fn)(void *, struct ggml_tensor *, int64_t, size_t);
typedef bool (*buft_is_host_fn)(void *);
typedef size_t (*tensor_overhead_fn)(void);

static custom_4d_fn custom_4d;
static view_1d_fn view_1d;
static buft_is_host_fn buft_is_host;
static atomic_long rows_drawn; /* draws made in graphs, for tests */

/* This thread's share of the row's first pass: a slice of its blocks' maxima, or for a
 * top-p alone (`summed`) of its parts' scans and sums, which the first thread folds. The
 * maxima lead the draw's scratch (rowdraw.c's start()), the parts' sums sit at
 * ls_draw_parts_at. Returns whether the share held a NaN. */
static int read_share(const GraphDraw *g, const float *row, int summed, int ith, int nth) {
    float *block_max = (float *)g->scratch;
    if (summed) {
        int64_t parts = ls_scan_parts(g->n);
        double *sums = (double *)(g->scratch + ls_draw_parts_at(g->n));
        int nan = 0;
        for (int64_t p = parts * ith / nth; p < parts * (ith + 1) / nth; p++)
            nan |= ls_scan_exp_sum_part(row, g->n, block_max, p, sums + 3 * p);
        return nan;
    }
    int64_t n_blocks = (g->n + BLOCK - 1) / BLOCK;
    int64_t first = n_blocks * ith / nth, last = n_blocks * (ith + 1) / nth;
    int64_t lo = first * BLOCK, hi = last * BLOCK < g->n ? last * BLOCK : g->n;
    return hi > lo && ls_block_max(row + lo, hi - lo, block_max + first);
}

static void draw_row(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    GraphDraw *g = userdata;
    const float *row = dst->src[0]->data;
    int64_t n = g->n, token;
    /* A top-p alone sums the row in its scan: in parts, on every thread, where the CPU has
     * AVX-512 for the sums; else the first thread draws it whole, as ls_draw does. */
    int summed = !g->greedy && ls_top_p_alone(n, (int64_t)g->settings[1], g->settings[2]);
    if (summed && ls_isa() < 2) {
        if (ith != 0) return;
        token = ls_draw(row, n, g->settings[0], (int64_t)g->settings[1], g->settings[2],
                        g->settings[3], g->settings[4], g->seed, g->scratch, g->found);
    } else {
        if (read_share(g, row, summed, ith, nth)) atomic_fetch_or(&g->nan, 1);
        atomic_fetch_add(&g->arrived, 1);
        if (ith != 0) return;
        /* The others are in this operation too (ggml runs every thread through each one):
         * their shares take as long as this thread's. */
        while (atomic_load(&g->arrived) < nth) {
        }
        int nan = atomic_load(&g->nan);
        atomic_store(&g->arrived, 0);
        atomic_store(&g->nan, 0);
        if (g->greedy) {
            token = ls_argmax_from(row, n, (const float *)g->scratch, nan);
        } else if (nan) {
            /* rowdraw.c's rule for a row with a NaN: its argmax (the first NaN), alone. */
            token = ls_argmax_from(row, n, (const float *)g->scratch, nan);
            g->found[0] = g->found[1] = 1.0;
        } else {
            double total = -1.0, weighted_depth = 0.0; /* not summed */
            if (summed)
                ls_scan_fold((const double *)(g->scratch + ls_draw_parts_at(n)),
                             ls_scan_parts(n), &total, &weighted_depth);
            token = ls_draw_from_scan(row, n, g->settings, g->seed, g->scratch, total,
                                      weighted_depth, g->found);
        }
    }
    g->token = token;
    atomic_fetch_add(&rows_drawn, 1);
    ((int32_t *)dst->data)[0] = (int32_t)token;
}

static const char *graph_draw_name(const struct llama_sampler *smpl) {
    (void)smpl;
    return "loomserve-draw";
}

/* On the host the worker draws with rowdraw.c itself; llama.cpp never calls this for a
 * sampler that only runs in the graph. */
static void graph_draw_apply(struct llama_sampler *smpl, void *candidates) {
    (void)smpl, (void)candidates;
}

/* The logits must be in host memory (a CPU's output layer), one output per sequence a pass. */
static bool graph_draw_backend_init(struct llama_sampler *smpl, void *buft, uint32_t n_max) {
    (void)smpl;
    return buft_is_host(buft) && n_max == 1;
}

static void graph_draw_backend_apply(struct llama_sampler *smpl, void *ctx, void *graph,
                                     struct llama_sampler_data *data) {
    /* llama.cpp hands a row of a padded copy of the logits; the row of the output layer's
     * own tensor is read instead, so that the copy is left out of the graph. */
    struct ggml_tensor *row = data->logits, *padded = row->view_src;
    struct ggml_tensor *logits = padded ? padded->src[0] : NULL;
    if (logits && logits->ne[0] == row->ne[0] &&
        row->view_offs / logits->nb[1] < (size_t)logits->ne[1])
        row = view_1d(ctx, logits, logits->ne[0], row->view_offs);
    pass_hook_fn hook = atomic_load(&pass_hook);
    if (hook) hook(graph);
    struct ggml_tensor *args[1] = {row};
    data->sampled = custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, args, 1, (void *)draw_row,
                              GGML_N_TASKS_MAX, smpl->ctx);
    data->logits = NULL; /* drawn: no logits to copy back */
}

static struct llama_sampler_i graph_draw_iface = {
    .name = graph_draw_name,
    .apply = graph_draw_apply,
    .backend_init = graph_draw_backend_init,
    .backend_apply = graph_draw_backend_apply,
};

/* The sampler interface for llama_sampler_init, with a GraphDraw as its context. */
void *ls_graph_iface(void) {
    return &graph_draw_iface;
}

int64_t ls_graph_draw_bytes(void) {
    return (int64_t)sizeof(GraphDraw);
}

/* ggml's calls, from the library at ggml_base (llama.cpp loaded it already). Returns 0 where
 * one is missing or ggml's tensor is not laid out as declared here. */
int ls_graph_bind(const char *ggml_base) {
    void *lib = dlopen(ggml_base, RTLD_NOW);
    if (!lib) return 0;
    custom_4d = (custom_4d_fn)dlsym(lib, "ggml_custom_4d");
    view_1d = (view_1d_fn)dlsym(lib, "ggml_view_1d");
    buft_is_host = (buft_is_host_fn)dlsym(lib, "ggml_backend_buft_is_host");
    tensor_overhead_fn overhead = (tensor_overhead_fn)dlsym(lib, "ggml_tensor_overhead");
    return custom_4d && view_1d && buft_is_host && overhead &&
           overhead() == GGML_OBJECT_SIZE + sizeof(struct ggml_tensor);
}

/* The function run on each drawing pass's graph as it is built (NULL for none). */
void ls_graph_set_pass_hook(void *hook) {
    atomic_store(&pass_hook, (pass_hook_fn)hook);
}

/* How many rows the samplers in graphs have drawn so far. */
int64_t ls_graph_rows_drawn(void) {
    return (int64_t)atomic_load(&rows_drawn);
}
