/* A token drawn from one row of logits in one call: temperature, top-k, top-p and min-p,
 * exact, by the same steps as the tests' numpy reference, tests/worker/sampling/oracle.py's
 * candidates() and pick() (read that file's docstrings first: the head, the tail drawn by
 * rejection, the nucleus cut from bounds on the row's mass), with no Python between them.
 *
 * Why: those steps in numpy (the worker's draw once) are numpy calls, each cheap, but a dozen
 * of them a token, each taking and giving back the GIL, cost as much as reading the row
 * itself (~190 us a token at Gemma's 262,144 tokens against ~90 us for the scan alone on this
 * project's Xeon), and two sampling threads then queue for the GIL instead of drawing side by
 * side. Here a token is one ctypes call, which lets go of the GIL for all of it.
 *
 * Every row is served here, on any CPU: a row whose best logit is not finite (a NaN, or every
 * token biased away) gives its argmax, as the reference does, and the rare top-p cut that even
 * the bounds from the float32 exponentials leave in doubt is settled by the row's mass summed
 * in extended precision (float64_cut). The tests hold the draws to the reference token set
 * for token set, and token for token from the same seed on those rows.
 *
 * Random numbers come from splitmix64 seeded with one 64-bit number per token from the
 * request's own generator, so a seeded request draws the same tokens alone, batched and
 * after a restart, and a draw never runs out of them.
 */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 256
/* rowscan.c's: the most rows ls_block_max_rows reads side by side. */
#define ROWS_AT_ONCE 4

/* rowscan.c's */
int ls_block_max(const float *row, int64_t n, float *block_max);
int64_t ls_argmax_from(const float *row, int64_t n, const float *block_max, int nan);
void ls_block_max_rows(const float *const *rows, int64_t count, int64_t n, float *block_max,
                       int *nan);
int64_t ls_gather(const float *row, int64_t n, const float *block_max, float low, float high,
                  int32_t *ids);
double ls_exp_sum_below(const float *row, int64_t n, float peak, float below);
int ls_scan_exp_sum(const float *row, int64_t n, float *block_max, double *total,
                    double *weighted_depth);
int64_t ls_scan_parts(int64_t n);
double ls_cumulative_weights(const float *row, const int32_t *ids, int64_t n, float peak,
                             double temperature, double start, double *weights);

/* oracle.py's constants, which say why each is what it is. */
static const double ENVELOPE_LIMIT = 4.0;
static const double NUCLEUS_SPAN = 8.0, NUCLEUS_BAND = 2.0, NUCLEUS_LAST_BAND = 40.0;
static const double NUCLEUS_MASS_SPAN = 16.0, NUCLEUS_BANDS[] = {20.0, 24.0};
static const double EXP_SUM_ERROR = 2e-6, EXP_ERROR = 4.8e-7, DEPTH_ERROR = 6e-8;
/* rowscan.c sums its float32 exponentials four to a lane in float32 before float64: two
 * roundings of 2^-24 each. */
static const double SUM32_ERROR = 1.2e-7;
static const int64_t HEAD_SHARE = 16;
/* Bounds on a mass are widened by this much of it, more than a float64 sum of a whole row's
 * terms in any order can be off by (262,144 additions: 3e-11 at worst). */
static const double SUM_SLACK = 1e-10;

typedef struct {
    uint64_t state;
} Rng;

static uint64_t next_u64(Rng *rng) {
    uint64_t z = (rng->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1), 53 random bits. */
static double uniform(Rng *rng) {
    return (double)(next_u64(rng) >> 11) * 0x1.0p-53;
}

/* Uniform in [0, n), without the modulo's bias (Lemire's multiply and reject). */
static int64_t uniform_below(Rng *rng, uint64_t n) {
    for (;;) {
        __uint128_t m = (__uint128_t)next_u64(rng) * n;
        uint64_t low = (uint64_t)m;
        if (low >= n || low >= (uint64_t)(-n) % n) return (int64_t)(m >> 64);
    }
}

/* One draw: the row, its scan, the caller's scratch and the random numbers. */
typedef struct {
    const float *row;
    int64_t n;
    float peak;          /* the row's best logit */
    float *block_max;    /* one per block (rowscan.c's ls_block_max) */
    int32_t *ids;        /* the candidates */
    int32_t *pool;       /* a head the nucleus is taken from */
    double *weights;     /* the candidates' weights, summed in order */
    uint64_t *keys;      /* sort keys */
    float *values;       /* logits copied out, for quickselect to reorder */
    Rng rng;
    double head_mass;    /* the candidates' tempered weight, in units of the best token's */
    int64_t kept;        /* how many candidates ids holds; -1 when a tail was kept too */
} Draw;

static int64_t align64(int64_t bytes) {
    return (bytes + 63) & ~(int64_t)63;
}

/* What one draw takes of its scratch; ls_draw_group's rows' block maxima follow, then room
 * for the sums of a row's scan in parts (graphdraw.c's threads scan a share each). */
static int64_t one_draw_bytes(int64_t n) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    return align64(n_blocks * 4) + 2 * align64(n * 4) + 2 * align64(n * 8) + align64(n * 4);
}

/* Where the scan's parts' sums go in the scratch: three doubles a part (rowscan.c's
 * ls_scan_exp_sum_part). */
int64_t ls_draw_parts_at(int64_t n) {
    return one_draw_bytes(n) + align64(ROWS_AT_ONCE * ((n + BLOCK - 1) / BLOCK) * 4);
}

/* The bytes of scratch ls_draw, ls_draw_group and graphdraw.c need for rows of n logits, and
 * where in it the candidates' ids are left (after the blocks' maxima). */
int64_t ls_draw_scratch_bytes(int64_t n) {
    return ls_draw_parts_at(n) + align64(ls_scan_parts(n) * 3 * 8);
}

int64_t ls_draw_ids_at(int64_t n) {
    return align64((n + BLOCK - 1) / BLOCK * 4);
}

/* The index of the interval of the cumulative weights that holds u (0 <= u < total): numpy's
 * searchsorted(side="right"), kept within the array. */
static int64_t interval_of(const double *cumulative, int64_t n, double u) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (cumulative[mid] <= u) lo = mid + 1;
        else hi = mid;
    }
    return lo < n ? lo : n - 1;
}

/* The first index whose cumulative weight reaches v (n if none): searchsorted(side="left"). */
static int64_t first_reaching(const double *cumulative, int64_t n, double v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (cumulative[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The weights of ids[0..n) over `temperature`, summed in order into weights; returns the
 * total. */
static double cumulate(const Draw *d, int64_t n, double temperature) {
    return ls_cumulative_weights(d->row, d->ids, n, d->peak, temperature, 0.0, d->weights);
}

/* A token from ids[0..n) by their tempered weights (oracle.py's pick without a tail). */
static int32_t pick_head(Draw *d, int64_t n, double temperature) {
    double total = cumulate(d, n, temperature);
    d->head_mass = total;
    d->kept = n;
    return d->ids[interval_of(d->weights, n, uniform(&d->rng) * total)];
}

/* Drops the ids under `least` (min-p's bar, compared in float64 as oracle.py's _kept does);
 * returns how many are left. */
static int64_t keep_over(const Draw *d, int64_t n, double least) {
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++)
        if ((double)d->row[d->ids[i]] >= least) d->ids[kept++] = d->ids[i];
    return kept;
}

/* The tokens of the row in the band low <= x < high, into ids (NULL: only counted). */
static int64_t gather(const Draw *d, float low, float high, int32_t *ids) {
    return ls_gather(d->row, d->n, d->block_max, low, high, ids);
}

/* temperature (and min-p) over the whole row: oracle.py's candidates() without top-k or top-p,
 * then pick(). */
static int32_t draw_tempered(Draw *d, double temperature, double least, double span) {
    const float *row = d->row;
    for (int widened = 0;; widened = 1) {
        /* Tail tokens score under the floor: each weighs under e^-span, tempered. */
        float floor = (float)((double)d->peak - span * temperature);
        if (least > (double)floor) {
            /* min-p keeps nothing under its bar, so there is no tail. */
            int64_t found = keep_over(d, gather(d, (float)least, INFINITY, d->ids), least);
            return pick_head(d, found, temperature);
        }
        int64_t found = gather(d, floor, INFINITY, d->ids);
        int64_t n_tail = d->n - found;
        if (!n_tail) return pick_head(d, found, temperature);
        double head = cumulate(d, found, temperature);
        double envelope = exp(((double)floor - d->peak) / temperature); /* > any tail token's */
        if (!widened && (double)n_tail * envelope > ENVELOPE_LIMIT * head) {
            span += log((double)n_tail * envelope / head); /* the hint was far off: once more */
            continue;
        }
        d->head_mass = head;
        d->kept = -1;
        double tail = (double)n_tail * envelope;
        for (;;) {
            double u = uniform(&d->rng) * (head + tail);
            if (u < head) return d->ids[interval_of(d->weights, found, u)];
            int64_t token;
            do token = uniform_below(&d->rng, (uint64_t)d->n);
            while (!(row[token] < floor));
            double value = row[token];
            if (value < least) continue; /* min-p refuses it: draw again from the start */
            if (uniform(&d->rng) * envelope < exp((value - d->peak) / temperature))
                return (int32_t)token;
        }
    }
}

/* ids[0..n) best first: by logit, higher first, ties by id (what a stable argsort of -logits
 * gives), as oracle.py's _best_first_order. The ids come in ascending order (every caller
 * gathers them so), so a stable sort by logit alone leaves ties in id order: a radix sort of
 * the logits' bits made to order as integers, a byte at a time, between keys and `spare` (room
 * for n each). qsort with a comparison function took 60-120 us for the 1,000-2,000 tokens of
 * a top-p's first band on Gemma's rows; this takes a few. */
static void best_first(const Draw *d, int32_t *ids, int64_t n, uint64_t *spare) {
    uint64_t *keys = d->keys, *into = spare;
    for (int64_t i = 0; i < n; i++) {
        float negated = -d->row[ids[i]] + 0.0f; /* -0.0 ties 0.0 */
        union {
            float f;
            uint32_t u;
        } bits = {negated};
        /* A float's bits order as unsigned integers once the sign bit is flipped, and a
         * negative float's other bits reversed. */
        uint32_t ordered = bits.u & 0x80000000u ? ~bits.u : bits.u | 0x80000000u;
        keys[i] = (uint64_t)ordered << 32 | (uint32_t)ids[i];
    }
    for (int shift = 32; shift < 64; shift += 8) {
        int64_t starts[257] = {0};
        for (int64_t i = 0; i < n; i++) starts[(keys[i] >> shift & 0xff) + 1]++;
        if (n && starts[(keys[0] >> shift & 0xff) + 1] == n) continue; /* one byte for all */
        for (int b = 0; b < 256; b++) starts[b + 1] += starts[b];
        for (int64_t i = 0; i < n; i++) into[starts[keys[i] >> shift & 0xff]++] = keys[i];
        uint64_t *swap = keys;
        keys = into;
        into = swap;
    }
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(uint32_t)keys[i];
}

/* The k-th largest of values[0..n) (1 <= k <= n), by quickselect; values is reordered. */
static float kth_largest(float *values, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = values[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (values[i] > pivot) i++;
            while (values[j] < pivot) j--;
            if (i <= j) {
                float t = values[i];
                values[i++] = values[j];
                values[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return values[want];
    }
    return values[want];
}

/* top-k, then top-p and min-p on what it keeps: oracle.py's _top_k_candidates, then pick(). The
 * k best are among the tokens that reach the k-th largest block maximum (each block's maximum
 * is a token's logit). */
static int32_t draw_top_k(Draw *d, double temperature, int64_t top_k, double top_p,
                          double least) {
    const float *row = d->row;
    int64_t n_blocks = (d->n + BLOCK - 1) / BLOCK;
    float low = -INFINITY;
    if (top_k <= n_blocks) {
        float *maxima = d->values;
        for (int64_t b = 0; b < n_blocks; b++) maxima[b] = d->block_max[b];
        low = kth_largest(maxima, n_blocks, top_k);
    }
    if (top_p == 1.0 && least > (double)low) low = (float)least; /* min-p keeps none under it */
    int64_t found = gather(d, low, INFINITY, d->ids);
    if (top_k < found) {
        /* The k best: those over the k-th best logit, then its ties by id. */
        float *values = d->values;
        for (int64_t i = 0; i < found; i++) values[i] = row[d->ids[i]];
        float kth = kth_largest(values, found, top_k);
        int64_t over = 0;
        for (int64_t i = 0; i < found; i++) over += row[d->ids[i]] > kth;
        int64_t kept = 0, ties = top_k - over;
        for (int64_t i = 0; i < found; i++) {
            float x = row[d->ids[i]];
            if (x > kth || (x == kth && ties-- > 0)) d->ids[kept++] = d->ids[i];
        }
        found = kept;
    }
    if (top_p < 1.0) {
        /* The smallest set of the best whose (untempered) mass reaches top_p of the k's. */
        best_first(d, d->ids, found, (uint64_t *)d->weights);
        double mass = cumulate(d, found, 1.0);
        int64_t last = first_reaching(d->weights, found, top_p * mass);
        found = (last < found ? last : found - 1) + 1;
    }
    if (least > -INFINITY) found = keep_over(d, found, least);
    return pick_head(d, found, temperature);
}

/* The best tokens of the pool (pool NULL: of the whole row), best first into ids, their
 * (untempered) weights summed in that order into weights, until they weigh `wanted` or the
 * pool is spent; returns how many. oracle.py's _best_first: band by band, each sorted alone. */
static int64_t take_best_first(Draw *d, const int32_t *pool, int64_t pool_size, double wanted) {
    const float *row = d->row;
    int64_t taken = 0, size = pool ? pool_size : d->n;
    double mass = 0.0, span = NUCLEUS_SPAN;
    float top = INFINITY; /* the band's upper edge (exclusive) */
    for (;;) {
        float floor = span < NUCLEUS_LAST_BAND ? (float)((double)d->peak - span) : -INFINITY;
        int32_t *band = d->ids + taken;
        int64_t got = 0;
        if (!pool) got = gather(d, floor, top, band);
        else
            for (int64_t i = 0; i < pool_size; i++) {
                float x = row[pool[i]];
                if (x >= floor && x < top) band[got++] = pool[i];
            }
        best_first(d, band, got, (uint64_t *)(d->weights + taken));
        mass = ls_cumulative_weights(row, band, got, d->peak, 1.0, mass, d->weights + taken);
        taken += got;
        if (mass >= wanted || taken == size) return taken;
        top = floor;
        span += NUCLEUS_BAND;
    }
}

/* The last token the nucleus keeps, of `taken` summed best first, if the row's whole mass
 * known only to lie between the two totals settles it; else -1. oracle.py's _settled_cut. */
static int64_t settled_cut(const Draw *d, int64_t taken, double top_p, double least_total,
                           double most_total) {
    int64_t last = first_reaching(d->weights, taken, top_p * least_total);
    if (last < taken && last == first_reaching(d->weights, taken, top_p * most_total)) return last;
    return -1;
}

static atomic_long float64_cuts; /* how many cuts float64_cut settled, for the tests */

/* The nucleus from the row's mass summed in float64 terms with an 80-bit sum (long double on
 * x86-64: 262,144 additions off by 1.4e-14 of the sum at worst, a few 1e-17 in practice,
 * besides each term's own float64 rounding): the reference's float64 sum, for the rare cut
 * that the float32 sums' bounds leave in doubt (oracle.py's _float64_cut). A few ms at Gemma's
 * 262,144 tokens, taken by about one top-p row in a thousand. How many tokens it keeps (in
 * ids, best first). */
static int64_t float64_cut(Draw *d, double top_p) {
    atomic_fetch_add(&float64_cuts, 1);
    long double sum = 0.0L;
    for (int64_t i = 0; i < d->n; i++) sum += exp((double)d->row[i] - (double)d->peak);
    double total = (double)sum;
    int64_t taken = take_best_first(d, NULL, 0, top_p * total);
    int64_t last = first_reaching(d->weights, taken, top_p * total);
    return (last < taken ? last : taken - 1) + 1;
}

/* How many top-p cuts float64_cut has settled so far (the tests check that it ran). */
int64_t ls_float64_cuts(void) {
    return (int64_t)atomic_load(&float64_cuts);
}

/* The nucleus from the whole row's float32 exponentials, summed as `total` to within `error`:
 * oracle.py's _summed_nucleus and _mass_from_rest. How many tokens it keeps (in ids, best
 * first). */
static int64_t summed_nucleus(Draw *d, double top_p, double total, double error) {
    double least_total = total - error, most_total = total + error;
    int64_t taken = take_best_first(d, NULL, 0, top_p * most_total);
    int64_t last = settled_cut(d, taken, top_p, least_total, most_total);
    if (last >= 0) return last + 1;
    /* In doubt: the taken tokens' float64 mass, plus the float32 sum of the rest under them
     * with its own error bound (much the smaller), narrows it. */
    double rest = ls_exp_sum_below(d->row, d->n, d->peak, d->row[d->ids[taken - 1]]);
    error = rest * (EXP_ERROR + SUM32_ERROR);
    if (rest > 0.0) {
        double depth = log((double)d->n / rest);
        error += DEPTH_ERROR * rest * (depth > 0.0 ? depth : 0.0);
    }
    double taken_mass = d->weights[taken - 1];
    least_total = (taken_mass + rest - error) * (1.0 - SUM_SLACK);
    most_total = (taken_mass + rest + error) * (1.0 + SUM_SLACK);
    last = settled_cut(d, taken, top_p, least_total, most_total);
    return last >= 0 ? last + 1 : float64_cut(d, top_p);
}

/* The nucleus from the row's exponentials summed again (rowscan.c's kernel), within
 * EXP_SUM_ERROR as for any row. */
static int64_t resummed_nucleus(Draw *d, double top_p) {
    double whole = ls_exp_sum_below(d->row, d->n, d->peak, INFINITY);
    return summed_nucleus(d, top_p, whole, whole * EXP_SUM_ERROR);
}

/* top-p without top-k: oracle.py's _nucleus_candidates. How many tokens the nucleus keeps (in
 * ids, best first). */
static int64_t nucleus(Draw *d, double top_p) {
    const float *row = d->row;
    float floor = (float)((double)d->peak - NUCLEUS_MASS_SPAN);
    /* A flat row: most blocks reach the head, and counting its tokens would read them all
     * again (70 us on Gemma's rows) for an answer the blocks already make near certain. */
    int64_t n_blocks = (d->n + BLOCK - 1) / BLOCK, reaching = 0;
    for (int64_t b = 0; b < n_blocks; b++) reaching += d->block_max[b] >= floor;
    if (2 * reaching > n_blocks || gather(d, floor, INFINITY, NULL) * HEAD_SHARE > d->n)
        return resummed_nucleus(d, top_p);
    int64_t n_head = gather(d, floor, INFINITY, d->pool);
    double head_mass = 0.0;
    for (int64_t i = 0; i < n_head; i++) head_mass += exp((double)row[d->pool[i]] - d->peak);
    /* The rest's mass bounded by counts: each token in a band weighs between its edges. */
    double least_rest = 0.0, most_rest = 0.0;
    int64_t above = n_head;
    float edge = floor;
    for (int band = 0; band < 2; band++) {
        float under = (float)((double)d->peak - NUCLEUS_BANDS[band]);
        int64_t count = above + gather(d, under, edge, NULL);
        least_rest += (double)(count - above) * exp((double)under - d->peak);
        most_rest += (double)(count - above) * exp((double)edge - d->peak);
        above = count;
        edge = under;
    }
    most_rest += (double)(d->n - above) * exp((double)edge - d->peak);
    double least_total = (head_mass + least_rest) * (1.0 - SUM_SLACK);
    double most_total = (head_mass + most_rest) * (1.0 + SUM_SLACK);
    int64_t taken = take_best_first(d, d->pool, n_head, top_p * most_total);
    int64_t last = settled_cut(d, taken, top_p, least_total, most_total);
    return last >= 0 ? last + 1 : resummed_nucleus(d, top_p);
}

/* A draw from `row`, its arrays laid out in scratch (ls_draw_scratch_bytes). */
static Draw start(const float *row, int64_t n, uint64_t seed, char *scratch) {
    Draw d = {.row = row, .n = n, .rng = {seed}};
    d.block_max = (float *)scratch;
    d.ids = (int32_t *)(scratch += ls_draw_ids_at(n));
    d.pool = (int32_t *)(scratch += align64(n * 4));
    d.weights = (double *)(scratch += align64(n * 4));
    d.keys = (uint64_t *)(scratch += align64(n * 8));
    d.values = (float *)(scratch + align64(n * 8));
    return d;
}

/* Whether a draw cuts by top-p with no top-k before it (its first pass then sums the row). */
static int top_p_alone(int64_t n, int64_t top_k, double top_p) {
    return top_p < 1.0 && !(0 < top_k && top_k < n);
}

/* A row with a NaN (`nan`) or no finite best logit (every token biased away, or one at
 * +inf): its argmax (numpy's: the first NaN, else the first largest logit), the one candidate,
 * as oracle.py's candidates() takes it: a broken forward pass gives a token, not an error. */
static int64_t argmax_draw(Draw *d, int nan, double *found) {
    int64_t token = ls_argmax_from(d->row, d->n, d->block_max, nan);
    d->ids[0] = (int32_t)token;
    found[0] = 1.0; /* the candidate's weight, in units of the best token's: its own */
    found[1] = 1.0;
    return token;
}

/* The rest of a draw once d->block_max holds its row's maxima (a row with no NaN) and, for a
 * top-p alone where the CPU could, `total` its mass within `error` (total < 0: not summed). */
static int64_t finish(Draw *d, double temperature, int64_t top_k, double top_p, double min_p,
                      double span, double total, double error, double *found) {
    int64_t n_blocks = (d->n + BLOCK - 1) / BLOCK;
    d->peak = -INFINITY;
    for (int64_t b = 0; b < n_blocks; b++)
        if (d->block_max[b] > d->peak) d->peak = d->block_max[b];
    if (!isfinite(d->peak)) return argmax_draw(d, 0, found);
    double least = min_p > 0.0 ? (double)d->peak + log(min_p) : -INFINITY;
    int64_t token;
    if (0 < top_k && top_k < d->n) token = draw_top_k(d, temperature, top_k, top_p, least);
    else if (top_p == 1.0) token = draw_tempered(d, temperature, least, span);
    else {
        int64_t kept = total >= 0.0 ? summed_nucleus(d, top_p, total, error) : nucleus(d, top_p);
        if (least > -INFINITY) kept = keep_over(d, kept, least);
        token = pick_head(d, kept, temperature);
    }
    found[0] = d->head_mass;
    found[1] = (double)d->kept;
    return token;
}

/* The error bound of a row's mass summed by its scan (ls_scan_exp_sum's total and weighted
 * depth): the exponentials' and the float32 sums' share of the total, and DEPTH_ERROR of
 * each term's depth. Where EXP_SUM_ERROR must assume the deepest mass a row can have (12.5
 * logits), this is the row's own (2.3 deep on Gemma's flat rows): a bound a third as wide, and
 * a cut in doubt, which reads the row again, a quarter as often. */
static double scan_error(double total, double weighted_depth) {
    return total * (EXP_ERROR + SUM32_ERROR + SUM_SLACK) + DEPTH_ERROR * weighted_depth;
}

/* A token drawn from softmax(row / temperature) over what top-k, top-p and min-p keep (top_k 0
 * and top_p 1: off; min_p 0: off), seeded by `seed`. `span`: how far under the best (in
 * untempered logits, over the temperature) the head reaches when nothing cuts (draw.py chooses
 * it). scratch: ls_draw_scratch_bytes(n) bytes, 64-byte aligned; the candidates' ids are left
 * ls_draw_ids_at(n) bytes in. found[0] gets the candidates' tempered weight in units of the
 * best token's (the hint for the request's next row), found[1] how many there are (-1 when the
 * tail was kept too: every token is a candidate). Returns the token. */
int64_t ls_draw(const float *row, int64_t n, double temperature, int64_t top_k, double top_p,
                double min_p, double span, uint64_t seed, char *scratch, double *found) {
    Draw d = start(row, n, seed, scratch);
    /* A top-p alone needs the row's mass on most of Gemma's rows (flat ones): summed in the
     * scan's own pass where the CPU can, so the bounds from counts are not needed. */
    double total = -1.0, weighted_depth = 0.0;
    int has_nan = top_p_alone(n, top_k, top_p)
                      ? ls_scan_exp_sum(row, n, d.block_max, &total, &weighted_depth)
                      : -1;
    if (has_nan < 0) has_nan = ls_block_max(row, n, d.block_max);
    if (has_nan) return argmax_draw(&d, 1, found);
    return finish(&d, temperature, top_k, top_p, min_p, span, total,
                  scan_error(total, weighted_depth), found);
}

/* ls_draw for a row (with no NaN) scanned already (graphdraw.c's threads read it a share
 * each): its blocks' maxima lead scratch; for a top-p alone where the CPU has AVX-512, total
 * and weighted_depth are ls_scan_exp_sum's (the parts folded with ls_scan_fold: the same
 * sums), else total is -1 (not summed). Settings as ls_draw_group's. */
int64_t ls_draw_from_scan(const float *row, int64_t n, const double *settings, uint64_t seed,
                          char *scratch, double total, double weighted_depth, double *found) {
    Draw d = start(row, n, seed, scratch);
    return finish(&d, settings[0], (int64_t)settings[1], settings[2], settings[3], settings[4],
                  total, scan_error(total, weighted_depth), found);
}

/* top_p_alone, for graphdraw.c. */
int ls_top_p_alone(int64_t n, int64_t top_k, double top_p) {
    return top_p_alone(n, top_k, top_p);
}

/* ls_draw for `count` rows (at most ROWS_AT_ONCE) of n logits each: tokens[i] from rows[i]
 * with settings[5 i ...] (temperature, top_k, top_p, min_p, span), seeds[i], found[2 i ...].
 * The rows whose draw begins with their blocks' maxima have them read side by side
 * (ls_block_max_rows); a top-p alone scans its own row as ls_draw does. */
void ls_draw_group(const float *const *rows, int64_t count, int64_t n, const double *settings,
                   const uint64_t *seeds, char *scratch, int64_t *tokens, double *found) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK, together[ROWS_AT_ONCE], n_together = 0;
    const float *together_rows[ROWS_AT_ONCE] = {0};
    int nan[ROWS_AT_ONCE];
    float *maxima = (float *)(scratch + one_draw_bytes(n));
    for (int64_t i = 0; i < count; i++) {
        const double *s = settings + 5 * i;
        if (top_p_alone(n, (int64_t)s[1], s[2])) continue;
        together[n_together] = i;
        together_rows[n_together++] = rows[i];
    }
    ls_block_max_rows(together_rows, n_together, n, maxima, nan);
    for (int64_t i = 0, k = 0; i < count; i++) {
        const double *s = settings + 5 * i;
        if (k < n_together && together[k] == i) {
            Draw d = start(rows[i], n, seeds[i], scratch);
            d.block_max = maxima + k * n_blocks;
            tokens[i] = nan[k++] ? argmax_draw(&d, 1, found + 2 * i)
                                 : finish(&d, s[0], (int64_t)s[1], s[2], s[3], s[4], -1.0, 0.0,
                                          found + 2 * i);
        } else {
            tokens[i] = ls_draw(rows[i], n, s[0], (int64_t)s[1], s[2], s[3], s[4], seeds[i],
                                scratch, found + 2 * i);
        }
    }
}
