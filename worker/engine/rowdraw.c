/* A token drawn from one row of logits in one call: temperature, top-k, min-p, and a top-p
 * after a top-k, exact, by the same steps as draw.py's candidates() and pick() (read that
 * file's docstring first: the head, the tail drawn by rejection, the bars), with no Python
 * between them.
 *
 * Why: draw.py's steps are numpy calls, each cheap, but a dozen of them a token, each taking
 * and giving back the GIL, cost as much as reading the row itself (~190 us a token at Gemma's
 * 262,144 tokens against ~90 us for the scan alone on this project's Xeon), and two sampling
 * threads then queue for the GIL instead of drawing side by side. Here a token is one ctypes
 * call, which lets go of the GIL for all of it.
 *
 * Not here: a top-p with no top-k before it (its exact cut needs the whole row's mass, with
 * error bounds and fallbacks draw.py keeps in one place), and a row holding a NaN: ls_draw
 * returns LS_NOT_SERVED and draw.py serves them.
 *
 * Random numbers come from splitmix64 seeded with one 64-bit number per token from the
 * request's own generator, so a seeded request draws the same tokens alone, batched and
 * after a restart, and a draw never runs out of them.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 256
#define LS_NOT_SERVED (-1)

/* rowscan.c's */
int ls_block_max(const float *row, int64_t n, float *block_max);
int64_t ls_gather(const float *row, int64_t n, const float *block_max, float low, float high,
                  int32_t *ids);

/* draw.py's ENVELOPE_LIMIT: a head whose tail envelope outweighs it this many times over is
 * widened once. */
static const double ENVELOPE_LIMIT = 4.0;

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

/* Where the caller's scratch goes: room for a whole row of each. */
typedef struct {
    float *block_max;    /* one per block */
    int32_t *ids;        /* token ids */
    double *weights;     /* their (cumulative) weights */
} Scratch;

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

/* The tempered weights of ids[0..n) summed in order, into weights; returns the total. */
static double cumulate(const float *row, const int32_t *ids, int64_t n, double peak,
                       double temperature, double *weights) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) weights[i] = sum += exp(((double)row[ids[i]] - peak) / temperature);
    return sum;
}

/* A token from ids[0..n) by their weights (draw.py's pick without a tail). */
static int32_t pick_head(const float *row, const int32_t *ids, int64_t n, double peak,
                         double temperature, double *weights, Rng *rng, double *head_mass) {
    double total = cumulate(row, ids, n, peak, temperature, weights);
    *head_mass = total;
    return ids[interval_of(weights, n, uniform(rng) * total)];
}

/* Drops the ids whose logit is under `least` (min-p's bar, compared in float64 as draw.py's
 * _kept does); returns how many are left. */
static int64_t keep_over(const float *row, int32_t *ids, int64_t n, double least) {
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++)
        if ((double)row[ids[i]] >= least) ids[kept++] = ids[i];
    return kept;
}

/* temperature (and min-p) over the whole row: draw.py's candidates() without top-k or top-p,
 * then pick(). */
static int32_t draw_tempered(const float *row, int64_t n, float peak, double temperature,
                             double least, double span, Scratch *s, Rng *rng, double *head_mass) {
    for (int widened = 0;; widened = 1) {
        /* Tail tokens score under the floor: each weighs under e^-span, tempered. */
        float floor = (float)((double)peak - span * temperature);
        if (least > (double)floor) {
            /* min-p keeps nothing under its bar, so there is no tail. */
            int64_t found = ls_gather(row, n, s->block_max, (float)least, INFINITY, s->ids);
            found = keep_over(row, s->ids, found, least);
            return pick_head(row, s->ids, found, peak, temperature, s->weights, rng, head_mass);
        }
        int64_t found = ls_gather(row, n, s->block_max, floor, INFINITY, s->ids);
        int64_t n_tail = n - found;
        if (!n_tail) return pick_head(row, s->ids, found, peak, temperature, s->weights, rng, head_mass);
        double head = cumulate(row, s->ids, found, peak, temperature, s->weights);
        double envelope = exp(((double)floor - peak) / temperature); /* > any tail token's */
        if (!widened && (double)n_tail * envelope > ENVELOPE_LIMIT * head) {
            span += log((double)n_tail * envelope / head); /* the hint was far off: once more */
            continue;
        }
        *head_mass = head;
        double tail = (double)n_tail * envelope;
        for (;;) {
            double u = uniform(rng) * (head + tail);
            if (u < head) return s->ids[interval_of(s->weights, found, u)];
            int64_t token;
            do token = uniform_below(rng, (uint64_t)n);
            while (!(row[token] < floor));
            double value = row[token];
            if (value < least) continue; /* min-p refuses it: draw again from the start */
            if (uniform(rng) * envelope < exp((value - peak) / temperature)) return (int32_t)token;
        }
    }
}

/* ids[0..n) best first: by logit, higher first, ties by id (what a stable argsort of -logits
 * gives), as draw.py's _best_first_order: one sort of 64-bit keys, the logit's bits made to
 * order as integers over the id. keys: room for n. */
static int by_key(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void best_first(const float *row, int32_t *ids, int64_t n, uint64_t *keys) {
    for (int64_t i = 0; i < n; i++) {
        float negated = -row[ids[i]] + 0.0f; /* -0.0 ties 0.0 */
        union { float f; uint32_t u; } bits = {negated};
        /* A float's bits order as unsigned integers once the sign bit is flipped, and a
         * negative float's other bits reversed. */
        uint32_t ordered = bits.u & 0x80000000u ? ~bits.u : bits.u | 0x80000000u;
        keys[i] = (uint64_t)ordered << 32 | (uint32_t)ids[i];
    }
    qsort(keys, (size_t)n, sizeof(uint64_t), by_key);
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

/* top-k, then top-p and min-p on what it keeps: draw.py's _top_k_candidates, then pick(). The
 * k best are among the tokens that reach the k-th largest block maximum (each block's maximum
 * is a token's logit). */
static int32_t draw_top_k(const float *row, int64_t n, float peak, double temperature,
                          int64_t top_k, double top_p, double least, Scratch *s, Rng *rng,
                          double *head_mass) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    float low = -INFINITY;
    if (top_k <= n_blocks) {
        /* weights' room, as floats, for the maxima's copy that quickselect reorders */
        float *maxima = (float *)s->weights;
        for (int64_t b = 0; b < n_blocks; b++) maxima[b] = s->block_max[b];
        low = kth_largest(maxima, n_blocks, top_k);
    }
    if (top_p == 1.0 && least > (double)low) low = (float)least; /* min-p keeps nothing under it */
    int64_t found = ls_gather(row, n, s->block_max, low, INFINITY, s->ids);
    if (top_k < found) {
        /* The k best: those over the k-th best logit, then its ties by id. */
        float *values = (float *)s->weights;
        for (int64_t i = 0; i < found; i++) values[i] = row[s->ids[i]];
        float kth = kth_largest(values, found, top_k);
        int64_t over = 0;
        for (int64_t i = 0; i < found; i++) over += row[s->ids[i]] > kth;
        int64_t kept = 0, ties = top_k - over;
        for (int64_t i = 0; i < found; i++) {
            float x = row[s->ids[i]];
            if (x > kth || (x == kth && ties-- > 0)) s->ids[kept++] = s->ids[i];
        }
        found = kept;
    }
    if (top_p < 1.0) {
        /* The smallest set of the best whose (untempered) mass reaches top_p of the k's. */
        best_first(row, s->ids, found, (uint64_t *)s->weights);
        double mass = cumulate(row, s->ids, found, peak, 1.0, s->weights);
        int64_t last = 0;
        while (last < found - 1 && s->weights[last] < top_p * mass) last++;
        found = last + 1;
    }
    if (least > -INFINITY) found = keep_over(row, s->ids, found, least);
    return pick_head(row, s->ids, found, peak, temperature, s->weights, rng, head_mass);
}

/* A token drawn from softmax(row / temperature) over what top-k, top-p and min-p keep (top_k 0
 * and top_p 1: off; least: min-p's bar, peak + ln(min_p), -inf when off), seeded by `seed`.
 * `span`: how far under the best (in untempered logits, over the temperature) the head reaches
 * when nothing cuts (draw.py chooses it). head_mass gets the head's tempered weight in units of
 * the best token's (the hint for the request's next row). Returns the token, or LS_NOT_SERVED:
 * a top-p without top-k, or a row whose largest logit is not finite (a NaN, every token
 * biased away). */
int64_t ls_draw(const float *row, int64_t n, double temperature, int64_t top_k, double top_p,
                double min_p, double span, uint64_t seed, float *block_max, int32_t *ids,
                double *weights, double *head_mass) {
    if (top_p < 1.0 && !(top_k > 0 && top_k < n)) return LS_NOT_SERVED;
    Scratch s = {block_max, ids, weights};
    if (ls_block_max(row, n, block_max)) return LS_NOT_SERVED;
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    float peak = -INFINITY;
    for (int64_t b = 0; b < n_blocks; b++) peak = block_max[b] > peak ? block_max[b] : peak;
    if (!isfinite(peak)) return LS_NOT_SERVED;
    double least = min_p > 0.0 ? (double)peak + log(min_p) : -INFINITY;
    Rng rng = {seed};
    if (top_k > 0 && top_k < n)
        return draw_top_k(row, n, peak, temperature, top_k, top_p, least, &s, &rng, head_mass);
    return draw_tempered(row, n, peak, temperature, least, span, &s, &rng, head_mass);
}
