/* DDTree's best-first pop order in C: ddtree_host._best_first, the same heap over the same keys.
 *
 * Compiled on first use by ddtree_native.py (cc -O2 -ffp-contract=off: no fused multiply-adds, so every sum is
 * the IEEE double sum Python makes). A heap entry's key is (-score, packed ranks): the packed ranks are unique,
 * so any correct priority queue pops the entries in the one order Python's heapq does. The packed ranks are the
 * rank tuple, digit r + 1 at depth d shifted by bits * (depth_limit - d), in an unsigned 128-bit integer (the
 * caller checks that they fit).
 *
 * Returns the number of nodes written (root included), or -1 at the first log-prob outside [lo, hi] and not 0
 * (NaN included): the caller then takes the fixed-point path, as the Python builder does.
 */
#include <stdint.h>
#include <stdlib.h>

typedef unsigned __int128 u128;

typedef struct {
    double neg;         /* -score */
    u128 packed;        /* rank digits */
    int64_t parent;     /* parent node */
    int64_t cell;       /* flat index in the [depth, k] tables */
    double parent_neg;  /* parent's -score */
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

static int outside(double x, double lo, double hi) {
    return !(lo <= x && x <= hi) && x != 0.0;
}

/* out: three rows of n_nodes + 1 eight-byte values: -scores (double), parents, cells (int64). */
int64_t ddtree_best_first(const float *values, int64_t stride, int64_t width, int64_t depth_limit,
                          int64_t n_nodes, int64_t bits, double lo, double hi, void *out) {
    double *neg_scores = (double *)out;
    int64_t *parents = (int64_t *)out + (n_nodes + 1);
    int64_t *cells = (int64_t *)out + 2 * (n_nodes + 1);
    entry *heap = malloc(sizeof(entry) * (size_t)(2 * n_nodes + 2));
    if (heap == NULL) return -2;
    int64_t size = 0;
    neg_scores[0] = 0.0;
    parents[0] = -1;
    cells[0] = -1;
    double x = values[0];
    if (outside(x, lo, hi)) { free(heap); return -1; }
    entry item = {-x, (u128)1 << (bits * (depth_limit - 1)), 0, 0, 0.0, 1};
    for (int64_t node = 1; node < n_nodes; node++) {
        neg_scores[node] = item.neg;
        parents[node] = item.parent;
        cells[node] = item.cell;
        int64_t d = item.depth;
        u128 unit = (u128)1 << (bits * (depth_limit - d));
        int64_t cell = item.cell + 1;
        if (cell < (d - 1) * stride + width) {   /* next sibling: same parent, next rank */
            x = values[cell];
            if (outside(x, lo, hi)) { free(heap); return -1; }
            entry sibling = {item.parent_neg - x, item.packed + unit, item.parent, cell, item.parent_neg, d};
            push(heap, &size, sibling);
        }
        if (d < depth_limit) {                    /* first child: the best token of the next position */
            int64_t child_cell = d * stride;
            x = values[child_cell];
            if (outside(x, lo, hi)) { free(heap); return -1; }
            u128 child_unit = (u128)1 << (bits * (depth_limit - d - 1));
            entry child = {item.neg - x, item.packed + child_unit, node, child_cell, item.neg, d + 1};
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
