/* DDTree's best-first pop order in C: ddtree_host._best_first, the same heap over the same keys.
 *
 * Compiled on first use by ddtree_native.py (cc -O2 -ffp-contract=off). Scores are the reference's fixed point:
 * log-probs quantized to multiples of 2**-40 as int64 (sums of at most 128 of them stay far inside int64), so
 * every sum is exact and no input sends the build elsewhere. float32 log-probs are quantized here, each when the
 * heap first reads it, exactly as ddtree_host._quantize_np does in float32; other dtypes come quantized.
 * A heap entry's key is (-score, packed ranks): the packed ranks are unique, so any correct priority queue pops
 * the entries in the one order Python's heapq does. The packed ranks are the rank tuple, digit r + 1 at depth d
 * shifted by bits * (depth_limit - d), in an unsigned 128-bit integer (the caller checks that they fit).
 *
 * Returns the number of nodes written (root included), or -2 when the heap cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef unsigned __int128 u128;

typedef struct {
    int64_t neg;        /* -score */
    u128 packed;        /* rank digits */
    int64_t parent;     /* parent node */
    int64_t cell;       /* flat index in the [depth, k] tables */
    int64_t parent_neg; /* parent's -score */
    int64_t depth;      /* 1-based */
} entry;

static int less(const entry *a, const entry *b) {
    if (a->neg != b->neg) return a->neg < b->neg;
    return a->packed < b->packed;
}

static void sift_down(entry *heap, int64_t n, int64_t i) {
    entry e = heap[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && less(&heap[c + 1], &heap[c])) c++;
        if (!less(&heap[c], &e)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = e;
}

static void push(entry *heap, int64_t *n, entry e) {
    int64_t i = (*n)++;
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!less(&e, &heap[p])) break;
        heap[i] = heap[p];
        i = p;
    }
    heap[i] = e;
}

static entry pop(entry *heap, int64_t *n) {
    entry top = heap[0];
    heap[0] = heap[--(*n)];
    if (*n > 0) sift_down(heap, *n, 0);
    return top;
}

/* heapq.heappushpop: the smaller of e and the heap's top; the other one stays. */
static entry pushpop(entry *heap, int64_t n, entry e) {
    if (n == 0 || less(&e, &heap[0])) return e;
    entry top = heap[0];
    heap[0] = e;
    sift_down(heap, n, 0);
    return top;
}

/* _quantize_np on one float32: NaN to the floor (fmaxf drops NaN, as np.fmax), clamped to [-floor, 0], times
 * 2**40 (exact in float32 from 2**-17 up), rounded half to even, as int64. */
static int64_t quantized(float x, float floor_value) {
    float v = fminf(fmaxf(x, -floor_value), 0.0f);
    return (int64_t)rintf(v * 1099511627776.0f);
}

typedef struct {
    const float *f32;      /* float32 log-probs, quantized on read; or NULL and */
    const int64_t *fixed;  /* log-probs quantized already */
    float floor_value;
} scores;

static int64_t score(const scores *v, int64_t cell) {
    return v->f32 != NULL ? quantized(v->f32[cell], v->floor_value) : v->fixed[cell];
}

/* values: float32 log-probs when is_float32 (floor_value: the reference's floor), else int64 fixed-point ones.
 * out: three rows of n_nodes + 1 int64 values: -scores (fixed point), parents, cells. */
int64_t ddtree_best_first(const void *values, int64_t is_float32, double floor_value, int64_t stride, int64_t width,
                          int64_t depth_limit, int64_t n_nodes, int64_t bits, int64_t *out) {
    scores v = {is_float32 ? (const float *)values : NULL, is_float32 ? NULL : (const int64_t *)values,
                (float)floor_value};
    int64_t *neg_scores = out;
    int64_t *parents = out + (n_nodes + 1);
    int64_t *cells = out + 2 * (n_nodes + 1);
    entry *heap = malloc(sizeof(entry) * (size_t)(2 * n_nodes + 2));
    if (heap == NULL) return -2;
    int64_t size = 0;
    neg_scores[0] = 0;
    parents[0] = -1;
    cells[0] = -1;
    entry item = {-score(&v, 0), (u128)1 << (bits * (depth_limit - 1)), 0, 0, 0, 1};
    for (int64_t node = 1; node < n_nodes; node++) {
        neg_scores[node] = item.neg;
        parents[node] = item.parent;
        cells[node] = item.cell;
        int64_t d = item.depth;
        u128 unit = (u128)1 << (bits * (depth_limit - d));
        int64_t cell = item.cell + 1;
        if (cell < (d - 1) * stride + width) {   /* next sibling: same parent, next rank */
            entry sibling = {item.parent_neg - score(&v, cell), item.packed + unit, item.parent, cell,
                             item.parent_neg, d};
            push(heap, &size, sibling);
        }
        if (d < depth_limit) {                    /* first child: the best token of the next position */
            int64_t child_cell = d * stride;
            u128 child_unit = (u128)1 << (bits * (depth_limit - d - 1));
            entry child = {item.neg - score(&v, child_cell), item.packed + child_unit, node, child_cell, item.neg,
                           d + 1};
            item = pushpop(heap, size, child);
        } else {                                  /* the prefixes still to pop come from the heap */
            item = pop(heap, &size);
        }
    }
    neg_scores[n_nodes] = item.neg;
    parents[n_nodes] = item.parent;
    cells[n_nodes] = item.cell;
    free(heap);
    return n_nodes + 1;
}
