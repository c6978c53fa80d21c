/*
 * Tree attention on CPU over vLLM's paged KV cache in the CPU "vec" layout.
 *
 * The semantics of vllm_ddtree/kernels/reference.py (tree requests only):
 * query row i of a tree request sees every context key (positions before
 * the request's query span) and the tree key ctx + j when bit j of its mask
 * row is set. Keys at or past seq_len are never read.
 *
 * With a sliding window (window > 0 positions, itself included) node i sits
 * at logical position ctx + depth[i] and keeps a context key p only when
 * ctx + depth[i] - p < window, a tree key j only when depth[i] - depth[j] <
 * window; blocks below every node's window are not read. A sink (one logit
 * per query head, unscaled, no value) starts the online softmax: running
 * max = the sink, running sum = 1.
 *
 * Cache layout ("vec", see kernels/cache_layout.py): per layer
 * [num_blocks, num_kv_heads, block_size, 2 * head_size]; within one
 * (block, head) the first block_size * head_size elements are K^T
 * ([head_size][block_size], token fastest), the next are V
 * ([block_size][head_size]).
 *
 * fp8 caches (kv_dtype 2 = e4m3, 3 = e5m2; one byte per element, see
 * kernels/fp8.py) are decoded exactly to fp32 through a 256-entry table as
 * each block is read. As vLLM's CPU attention op does, the per-tensor scales
 * stay outside the dot products: the logits are (q . k) * scale * k_scale
 * (the query unscaled) and the output is (sum p v) * v_scale / sum p.
 *
 * One task per (tree request, kv head, chunk of query rows): the task's
 * rows (nodes x grouped query heads) walk the request's blocks once with an
 * online softmax in fp32, so each cache block is read once per task. A
 * request's rows are split into chunks only when there are too few
 * (request, kv head) pairs to fill the threads: one request with one kv
 * head then still uses every core. Plain C, built at first use by
 * kernels/cpu_native.py; the tasks run in parallel under OpenMP.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
  uint32_t u = ((uint32_t)x) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* The value of every fp8 code. e4m3: bias 7, subnormals m * 2^-9, no
 * inf/NaN (0x7F reads as 480, as in vLLM's CPU op); e5m2: the high byte of
 * an IEEE half. */
static void fp8_table(int e5m2, float *t) {
  for (int c = 0; c < 256; ++c) {
    const float sign = (c & 0x80) ? -1.f : 1.f;
    float mag;
    if (!e5m2) {
      const int e = (c >> 3) & 15, m = c & 7;
      mag = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    } else {
      const int e = (c >> 2) & 31, m = c & 3;
      mag = e == 31 ? (m ? NAN : INFINITY)
                    : e ? ldexpf((float)(4 + m), e - 17) : ldexpf((float)m, -16);
    }
    t[c] = sign * mag;
  }
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define RT 4 /* query rows per tile: K and V are loaded once per tile */

static inline v8f load8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f select8(v8i m, v8f a, v8f b) { /* m ? a : b, lane-wise */
  return (v8f)((m & (v8i)a) | (~m & (v8i)b));
}

/* exp(x) for x <= 0 on 8 lanes in fp32 (Cephes-style range reduction and
 * polynomial, about 2 ulp), branch-free so that it vectorizes; lanes below
 * -87 (masked keys are -inf) give exactly 0. */
static inline v8f exp_nonpos8(v8f x) {
  const v8f lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
  const v8f zero = {0.f};
  const v8i dead = x < lo;
  x = select8(dead, lo, x);
  const v8f y = x * 1.44269504088896341f;
  const v8f k = -__builtin_convertvector(__builtin_convertvector(0.5f - y, v8i), v8f);
  const v8f r = x - k * 0.693359375f + k * 2.12194440e-4f;
  v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  return select8(dead, zero, p * (v8f)bits);
}

/* kv_dtype: 0 = float32, 1 = bfloat16, 2 = fp8 e4m3, 3 = fp8 e5m2 (k_scale
 * and v_scale are read for fp8 only). query/out: float32 with the given
 * element strides. head_size must be a multiple of 8 and block_size of 8.
 * Returns 0, or a negative value on bad arguments. */
int ddtree_tree_attention(
    const float *query, int64_t q_stride_tok, int64_t q_stride_head,
    const void *kv_cache, int32_t kv_dtype, int64_t num_kv_heads, int64_t block_size,
    int64_t head_size, const int32_t *block_table, int64_t bt_stride,
    const int32_t *query_start_loc, const int32_t *seq_lens, const int64_t *tree_reqs,
    int64_t num_tree_reqs, const int32_t *mask, int64_t mask_words, int64_t num_q_heads,
    float scale, float k_scale, float v_scale, int64_t window, const int32_t *depth,
    const float *sinks, float *out, int64_t o_stride_tok, int64_t o_stride_head) {
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || block_size <= 0 ||
      block_size % 8 != 0 || head_size <= 0 || head_size % 8 != 0 || kv_dtype < 0 ||
      kv_dtype > 3 || window < 0 || (window > 0 && !depth))
    return -1;
  const int fp8 = kv_dtype >= 2;
  float lut[256];
  if (fp8) fp8_table(kv_dtype == 3, lut);
  /* unquantized: the query carries the softmax scale; fp8: the logits get
   * scale * k_scale after the dot product and the output v_scale */
  const float q_scale = fp8 ? 1.f : scale;
  const float logit_scale = scale * k_scale;
  const v8f logit_scale8 = {logit_scale, logit_scale, logit_scale, logit_scale,
                            logit_scale, logit_scale, logit_scale, logit_scale};
  const float out_scale = fp8 ? v_scale : 1.f;
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t D = head_size, BS = block_size;
  const int64_t block_elems = BS * 2 * D; /* one (block, head) */
  int status = 0;

  /* Tasks: (tree request, kv head, chunk of row tiles). A request's rows
   * are split only when there are fewer than two (request, kv head) pairs
   * per thread, so that one request with one kv head still fills the
   * cores; each chunk converts and reads the request's blocks once. */
  int64_t max_rows = 1;
  for (int64_t ti = 0; ti < num_tree_reqs; ++ti) {
    const int64_t r = tree_reqs[ti];
    const int64_t rows = (query_start_loc[r + 1] - query_start_loc[r]) * group;
    max_rows = rows > max_rows ? rows : max_rows;
  }
  const int64_t pairs = num_tree_reqs * num_kv_heads;
  int64_t splits = pairs > 0 ? (2 * (int64_t)omp_get_max_threads() + pairs - 1) / pairs : 1;
  splits = splits < 1 ? 1 : splits;
  const int64_t chunk_tiles = ((max_rows + RT - 1) / RT + splits - 1) / splits;
  const int64_t chunk_rows = (chunk_tiles < 1 ? 1 : chunk_tiles) * RT;
  const int64_t max_chunks = (max_rows + chunk_rows - 1) / chunk_rows;

#pragma omp parallel for collapse(3) schedule(dynamic)
  for (int64_t ti = 0; ti < num_tree_reqs; ++ti) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
    for (int64_t chunk = 0; chunk < max_chunks; ++chunk) {
      const int64_t r = tree_reqs[ti];
      const int64_t qs = query_start_loc[r];
      const int64_t ql = query_start_loc[r + 1] - qs;
      const int64_t seq = seq_lens[r];
      const int64_t ctx = seq - ql;
      const int64_t all_rows = ql * group; /* row = node * group + g */
      const int64_t row0 = chunk * chunk_rows;
      if (ql <= 0 || row0 >= all_rows) continue;
      if (ctx < 0 || ql > mask_words * 32) {
#pragma omp atomic write
        status = -2;
        continue;
      }
      /* this chunk's rows: row0 .. row0 + rows - 1 of the request's */
      const int64_t rows = all_rows - row0 < chunk_rows ? all_rows - row0 : chunk_rows;
      const int64_t tiles = (rows + RT - 1) / RT;
      float *m = malloc(sizeof(float) * tiles * RT);
      float *l = malloc(sizeof(float) * tiles * RT);
      float *qbuf = malloc(sizeof(float) * tiles * RT * D);
      float *acc = calloc((size_t)(tiles * RT * D), sizeof(float));
      float *s = malloc(sizeof(float) * RT * BS);
      float *kbuf = kv_dtype ? malloc(sizeof(float) * BS * D) : NULL;
      float *vbuf = kv_dtype ? malloc(sizeof(float) * BS * D) : NULL;
      if (!m || !l || !qbuf || !acc || !s || (kv_dtype && (!kbuf || !vbuf))) {
#pragma omp atomic write
        status = -3;
        free(m); free(l); free(qbuf); free(acc); free(s); free(kbuf); free(vbuf);
        continue;
      }
      /* Scaled queries, one row per (node, g); padding rows repeat the last. */
      for (int64_t row = 0; row < tiles * RT; ++row) {
        const int64_t rr = row0 + (row < rows ? row : rows - 1);
        const float *q = query + (qs + rr / group) * q_stride_tok +
                         (h * group + rr % group) * q_stride_head;
        for (int64_t d = 0; d < D; ++d) qbuf[row * D + d] = q[d] * q_scale;
        m[row] = sinks ? sinks[h * group + rr % group] : -INFINITY;
        l[row] = sinks ? 1.f : 0.f;
      }
      /* Keys before lo are outside every node's window (the tree's own span
       * is always read), so blocks wholly before lo, which vLLM may have
       * freed, are skipped; blocks from all_lo on are inside every window. */
      const int32_t *dep = window > 0 ? depth + qs : NULL;
      int64_t lo = 0, all_lo = 0;
      if (dep) {
        int64_t dmin = dep[0], dmax = dep[0];
        for (int64_t i = 1; i < ql; ++i) {
          dmin = dep[i] < dmin ? dep[i] : dmin;
          dmax = dep[i] > dmax ? dep[i] : dmax;
        }
        lo = ctx + dmin - window + 1;
        lo = lo > ctx ? ctx : lo < 0 ? 0 : lo;
        all_lo = ctx + dmax - window + 1;
      }
      const int64_t nblk = (seq + BS - 1) / BS;
      for (int64_t b = lo / BS; b < nblk; ++b) {
        const int64_t blk = block_table[r * bt_stride + b];
        const int64_t t0 = b * BS;
        const int64_t tn = seq - t0 < BS ? seq - t0 : BS;
        const float *kt, *v;
        if (kv_dtype == 0) {
          const float *base = (const float *)kv_cache + (blk * num_kv_heads + h) * block_elems;
          kt = base;
          v = base + BS * D;
        } else if (kv_dtype == 1) {
          const uint16_t *base =
              (const uint16_t *)kv_cache + (blk * num_kv_heads + h) * block_elems;
          for (int64_t e = 0; e < BS * D; ++e) kbuf[e] = bf16_to_f32(base[e]);
          for (int64_t e = 0; e < BS * D; ++e) vbuf[e] = bf16_to_f32(base[BS * D + e]);
          kt = kbuf;
          v = vbuf;
        } else {
          const uint8_t *base =
              (const uint8_t *)kv_cache + (blk * num_kv_heads + h) * block_elems;
          for (int64_t e = 0; e < BS * D; ++e) kbuf[e] = lut[base[e]];
          for (int64_t e = 0; e < BS * D; ++e) vbuf[e] = lut[base[BS * D + e]];
          kt = kbuf;
          v = vbuf;
        }
        const int all_visible = t0 + tn <= ctx && t0 >= all_lo;
        for (int64_t tile = 0; tile < tiles; ++tile) {
          const float *qt = qbuf + tile * RT * D;
          /* S = Q K^T over the whole block, 8 keys x RT rows in registers. */
          for (int64_t c = 0; c < BS; c += 8) {
            v8f a[RT] = {{0}};
            for (int64_t d = 0; d < D; ++d) {
              const v8f k = load8(kt + d * BS + c);
              for (int i = 0; i < RT; ++i) a[i] += qt[i * D + d] * k;
            }
            if (fp8)
              for (int i = 0; i < RT; ++i) a[i] *= logit_scale8;
            for (int i = 0; i < RT; ++i) store8(s + i * BS + c, a[i]);
          }
          for (int i = 0; i < RT; ++i) {
            const int64_t row = tile * RT + i;
            float *sc = s + i * BS;
            /* keys past the sequence hold stale values: never seen */
            for (int64_t t = tn; t < BS; ++t) sc[t] = -INFINITY;
            if (!all_visible) {
              const int64_t node = (row0 + (row < rows ? row : rows - 1)) / group;
              const int32_t *mrow = mask + (qs + node) * mask_words;
              const int64_t di = dep ? dep[node] : 0;
              for (int64_t t = 0; t < tn; ++t) {
                const int64_t p = t0 + t;
                if (p >= ctx) {
                  const int64_t j = p - ctx;
                  const uint32_t word = (uint32_t)mrow[j >> 5];
                  if (!((word >> (j & 31)) & 1u) || (dep && di - dep[j] >= window))
                    sc[t] = -INFINITY;
                } else if (dep && ctx + di - p >= window) {
                  sc[t] = -INFINITY;
                }
              }
            }
            float bmax = -INFINITY;
            for (int64_t t = 0; t < tn; ++t) bmax = sc[t] > bmax ? sc[t] : bmax;
            if (bmax == -INFINITY) {
              for (int64_t t = 0; t < BS; ++t) sc[t] = 0.f;
              continue;
            }
            const float m_new = m[row] > bmax ? m[row] : bmax;
            const float alpha = expf(m[row] - m_new); /* 0 when m was -inf */
            float lsum = 0.f;
            const v8f mv = {m_new, m_new, m_new, m_new, m_new, m_new, m_new, m_new};
            v8f ls = mv - mv;
            for (int64_t t = 0; t < BS; t += 8) {
              const v8f e = exp_nonpos8(load8(sc + t) - mv); /* -inf lanes give 0 */
              store8(sc + t, e);
              ls += e;
            }
            for (int i = 0; i < 8; ++i) lsum += ls[i];
            l[row] = l[row] * alpha + lsum;
            m[row] = m_new;
            float *ar = acc + row * D;
            for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          }
          /* acc += P V, 8 head dims x RT rows in registers; t < tn only
           * (past the sequence V may be anything, even NaN). */
          for (int64_t c = 0; c < D; c += 8) {
            v8f a[RT];
            for (int i = 0; i < RT; ++i) a[i] = load8(acc + (tile * RT + i) * D + c);
            for (int64_t t = 0; t < tn; ++t) {
              const v8f vv = load8(v + t * D + c);
              for (int i = 0; i < RT; ++i) a[i] += s[i * BS + t] * vv;
            }
            for (int i = 0; i < RT; ++i) store8(acc + (tile * RT + i) * D + c, a[i]);
          }
        }
      }
      for (int64_t row = 0; row < rows; ++row) {
        const int64_t i = (row0 + row) / group, g = (row0 + row) % group;
        float *o = out + (qs + i) * o_stride_tok + (h * group + g) * o_stride_head;
        const float inv = l[row] > 0.f ? out_scale / l[row] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[row * D + d] * inv;
      }
      free(m); free(l); free(qbuf); free(acc); free(s); free(kbuf); free(vbuf);
    }
    }
  }
  return status;
}

/* ------------------------------------------------------------------------
 * Tree construction on CPU: the `budget` most probable prefixes per request.
 *
 * The semantics of vllm_ddtree.core.tree.build_tree: `lp` holds the drafter's
 * per-position log-probabilities [b, K, V] (float32, log-softmax already
 * applied); prefix u = (u_1..u_d) scores sum_i lp[i][u_i], accumulated in
 * depth order in fp32. Nodes come out in flat order: score descending,
 * parents before children; tail columns past the available prefixes or the
 * request's own budget are invalid (token 0, parent 0, depth 1, -inf).
 *
 * Per request: the top k = min(budget, V) tokens of each position (ties:
 * lower token id first), then a best-first enumeration. Every prefix has one
 * generator, (.., j-1) -> (.., j) or (..) -> (.., 0), and both moves never
 * raise the score, so popping a max-heap yields the prefixes in descending
 * order, each parent before its children.
 * ---------------------------------------------------------------------- */

typedef struct {
  float score;
  int32_t depth;  /* 1..K */
  int32_t rank;   /* rank of the last token within its position's top k */
  int32_t parent; /* flat index of the parent (0 = root) */
  int64_t order;  /* push order: ties pop first-pushed first */
} cand_t;

static int cand_before(const cand_t *a, const cand_t *b) { /* a pops before b */
  if (a->score != b->score) return a->score > b->score;
  if (a->depth != b->depth) return a->depth < b->depth;
  return a->order < b->order;
}

static void heap_push(cand_t *h, int64_t *n, cand_t c) {
  int64_t i = (*n)++;
  while (i > 0) {
    int64_t p = (i - 1) / 2;
    if (!cand_before(&c, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = c;
}

static cand_t heap_pop(cand_t *h, int64_t *n) {
  cand_t top = h[0], last = h[--(*n)];
  int64_t i = 0;
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && cand_before(&h[c + 1], &h[c])) c++;
    if (!cand_before(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n > 0) h[i] = last;
  return top;
}

/* Returns 0, or a negative value on bad arguments. */
int ddtree_build_tree(const float *lp, int64_t batch, int64_t num_levels, int64_t vocab,
                      int64_t budget, const int64_t *budgets, int64_t *tokens,
                      int64_t *parents, int64_t *depth, float *logq, uint8_t *valid) {
  if (batch < 0 || num_levels <= 0 || vocab <= 0 || budget <= 0) return -1;
  const int64_t k = budget < vocab ? budget : vocab;
  int status = 0;
#pragma omp parallel for schedule(dynamic)
  for (int64_t b = 0; b < batch; ++b) {
    float *top_lp = malloc(sizeof(float) * num_levels * k);
    int64_t *top_tok = malloc(sizeof(int64_t) * num_levels * k);
    cand_t *heap = malloc(sizeof(cand_t) * (2 * budget + 2));
    float *score_of = malloc(sizeof(float) * (budget + 1)); /* per flat node */
    if (!top_lp || !top_tok || !heap || !score_of) {
#pragma omp atomic write
      status = -3;
      free(top_lp); free(top_tok); free(heap); free(score_of);
      continue;
    }
    score_of[0] = 0.f;
    /* top k per position by insertion into a sorted list (k is small) */
    for (int64_t d = 0; d < num_levels; ++d) {
      const float *row = lp + (b * num_levels + d) * vocab;
      float *tv = top_lp + d * k;
      int64_t *ti = top_tok + d * k;
      int64_t n = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        const float x = row[v];
        if (n == k && !(x > tv[k - 1])) continue; /* ties keep the lower id */
        int64_t i = n < k ? n++ : k - 1;
        while (i > 0 && x > tv[i - 1]) {
          tv[i] = tv[i - 1];
          ti[i] = ti[i - 1];
          --i;
        }
        tv[i] = x;
        ti[i] = v;
      }
    }
    const int64_t own = budgets ? (budgets[b] < budget ? budgets[b] : budget) : budget;
    int64_t hn = 0, pushes = 0, m = 0;
    cand_t first = {0.f + top_lp[0], 1, 0, 0, pushes++};
    heap_push(heap, &hn, first);
    while (hn > 0 && m < budget) {
      const cand_t c = heap_pop(heap, &hn);
      const int64_t flat = ++m; /* 1..budget */
      const int64_t col = flat - 1;
      tokens[b * budget + col] = top_tok[(c.depth - 1) * k + c.rank];
      parents[b * budget + col] = c.parent;
      depth[b * budget + col] = c.depth;
      logq[b * budget + col] = c.score;
      score_of[flat] = c.score;
      /* next sibling: same parent, next token of the same position (the
       * score is the parent's plus one term, as build_tree sums it) */
      if (c.rank + 1 < k) {
        cand_t s = {score_of[c.parent] + top_lp[(c.depth - 1) * k + c.rank + 1], c.depth,
                    c.rank + 1, c.parent, pushes++};
        heap_push(heap, &hn, s);
      }
      /* first child */
      if (c.depth < num_levels) {
        cand_t ch = {c.score + top_lp[c.depth * k], c.depth + 1, 0, (int32_t)flat, pushes++};
        heap_push(heap, &hn, ch);
      }
    }
    for (int64_t col = 0; col < budget; ++col) {
      const int ok = col < m && col < own;
      valid[b * budget + col] = (uint8_t)ok;
      if (!ok) {
        tokens[b * budget + col] = 0;
        parents[b * budget + col] = 0;
        depth[b * budget + col] = 1;
        logq[b * budget + col] = -INFINITY;
      }
    }
    free(top_lp); free(top_tok); free(heap); free(score_of);
  }
  return status;
}

/* ------------------------------------------------------------------------
 * KV compaction on CPU: copy the K/V of cache slots src[i] to dst[i] in
 * each of `num_layers` caches in the "vec" layout (element size 1, 2 or 4
 * bytes: an fp8 cache's codes move as they are, never re-quantized). Every
 * source of a layer is read before any destination of it is written, so
 * overlapping moves are safe. Slots are block * block_size + offset, as in
 * vLLM's slot mapping.
 * ---------------------------------------------------------------------- */
int ddtree_move_slots(void *const *caches, int64_t num_layers, int64_t elem_size,
                      int64_t num_blocks, int64_t num_kv_heads, int64_t block_size,
                      int64_t head_size, const int64_t *src, const int64_t *dst, int64_t n) {
  if ((elem_size != 1 && elem_size != 2 && elem_size != 4) || block_size <= 0 ||
      head_size <= 0)
    return -1;
  for (int64_t i = 0; i < n; ++i)
    if (src[i] < 0 || dst[i] < 0 || src[i] >= num_blocks * block_size ||
        dst[i] >= num_blocks * block_size)
      return -2;
  const int64_t D = head_size, BS = block_size;
  const int64_t per_slot = num_kv_heads * 2 * D; /* K and V values of one slot */
  unsigned char *buf = malloc((size_t)(n * per_slot * elem_size));
  if (!buf) return -3;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    unsigned char *cache = caches[layer];
    /* gather (pairs that stay in place are skipped) */
    for (int64_t i = 0; i < n; ++i) {
      if (src[i] == dst[i]) continue;
      const int64_t blk = src[i] / BS, off = src[i] % BS;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        unsigned char *base = cache + ((blk * num_kv_heads + h) * BS * 2 * D) * elem_size;
        unsigned char *out = buf + ((i * num_kv_heads + h) * 2 * D) * elem_size;
        for (int64_t d = 0; d < D; ++d) /* K^T: [D][BS] */
          memcpy(out + d * elem_size, base + (d * BS + off) * elem_size, elem_size);
        memcpy(out + D * elem_size, base + (BS * D + off * D) * elem_size, D * elem_size);
      }
    }
    /* scatter */
    for (int64_t i = 0; i < n; ++i) {
      if (src[i] == dst[i]) continue;
      const int64_t blk = dst[i] / BS, off = dst[i] % BS;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        unsigned char *base = cache + ((blk * num_kv_heads + h) * BS * 2 * D) * elem_size;
        const unsigned char *in = buf + ((i * num_kv_heads + h) * 2 * D) * elem_size;
        for (int64_t d = 0; d < D; ++d)
          memcpy(base + (d * BS + off) * elem_size, in + d * elem_size, elem_size);
        memcpy(base + (BS * D + off * D) * elem_size, in + D * elem_size, D * elem_size);
      }
    }
  }
  free(buf);
  return 0;
}

/* ------------------------------------------------------------------------
 * Gated DeltaNet tree verification on CPU: one layer's convolution and
 * recurrence for every speculative token of a step, in one call. The
 * semantics are those of kernels/gdn_tree_reference.py (tree_conv_update_ref
 * with the CPU conv buffer, tree_recurrent_update_ref with vLLM CPU's state
 * layout):
 *
 * - token t of sequence i (tokens cu[i] .. cu[i+1]-1, local index j, local
 *   parent parent[t], -1 for the root, parents before children) convolves
 *   the last W inputs on its root-to-t path; where the path is shorter the
 *   window continues into the prior window, buffer columns off .. off+W-2 of
 *   slot idx[i, 0], off = num_acc[i] - 1;
 * - the buffer then holds the prior window less its oldest input in
 *   columns 0 .. W-3 and input j in column W-2+j;
 * - the recurrence starts from state slot idx[i, num_acc[i]-1]; a token
 *   whose parent is not the token before it restarts from its parent's
 *   stored state; every token's state is stored to slot idx[i, j]. Within a
 *   run of consecutive tokens the state stays in fp32, as in vLLM's chain
 *   kernel, so a chain-shaped tree is the chain.
 *
 * Per value head hv (key head hv / (HV / H)), per token, in fp32:
 *   q, k l2-normalised (eps 1e-6), q scaled; g = -exp(A_log) *
 *   softplus(a + dt_bias) (threshold 20); beta = sigmoid(b);
 *   h *= exp(g); u = (v - h^T k) * beta; h += k u^T; o = h^T q
 * with h[K][V] per head, the layout vLLM CPU's kernel reads.
 *
 * Dtype codes: 0 = float32, 1 = bfloat16. The convolution accumulates in
 * fp32 and rounds as the stock path does: to the conv buffer's dtype before
 * and after the activation, then to the input's dtype (the recurrence reads
 * q, k, v in that dtype); stored states are rounded to the state's dtype
 * (to nearest even).
 * The state's slots are ssm_slot elements apart, each [HV, K, V] contiguous.
 * scratch: float32 [T, dim]; gates: float32 [T, HV, 2]; tok_seq: int32 [T].
 * K must be a multiple of 4, V of 16. Returns 0, or a negative value on bad input.
 * ---------------------------------------------------------------------- */

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; branch-free */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : rounded; /* NaN */
  return (uint16_t)(r >> 16);
}

static inline float ld_dt(const void *p, int64_t i, int dt) {
  return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st_dt(void *p, int64_t i, int dt, float v) {
  if (dt)
    ((uint16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

static inline float round_dt(float v, int dt) { return dt ? bf16_to_f32(f32_to_bf16(v)) : v; }

#define GDN_BV 16 /* value columns per recurrence tile: one v16f */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load_bf16x16(const uint16_t *p) {
  v16h x;
  memcpy(&x, p, sizeof x);
  return (v16f)(__builtin_convertvector(x, v16u) << 16);
}

static inline v16f round_bf16x16(v16f f) { /* to bf16 and back */
  const v16u u = (v16u)f;
  const v16u rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
  const v16u r = ((v16u)nan & (u | 0x400000u)) | (~(v16u)nan & rounded);
  return (v16f)((r >> 16) << 16);
}

static inline v16f load16_dt(const void *p, int dt) {
  if (dt) return load_bf16x16(p);
  v16f v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* sigmoid(x) on 16 lanes from exp_nonpos8 of -|x| (no overflow either side) */
static inline v16f sigmoid16(v16f x) {
  const v16i neg = x < 0.f;
  const v16f minus_abs = (v16f)((v16i)x | (v16i)((v16u){0} + 0x80000000u));
  v8f lo, hi;
  memcpy(&lo, &minus_abs, sizeof lo);
  memcpy(&hi, (const char *)&minus_abs + sizeof lo, sizeof hi);
  lo = exp_nonpos8(lo);
  hi = exp_nonpos8(hi);
  v16f e;
  memcpy(&e, &lo, sizeof lo);
  memcpy((char *)&e + sizeof lo, &hi, sizeof hi);
  const v16f one = (v16f){0.f} + 1.f;
  return (v16f)((neg & (v16i)e) | (~neg & (v16i)one)) / (one + e);
}

static inline void store_bf16x16(uint16_t *p, v16f f) {
  const v16h x = __builtin_convertvector((v16u)round_bf16x16(f) >> 16, v16h);
  memcpy(p, &x, sizeof x);
}

int ddtree_gdn_tree(
    const void *x, int x_dt, int64_t dim,                   /* [T, dim] */
    void *conv_buf, int cb_dt, int64_t cb_slot, int64_t cb_dim, int64_t cb_col,
    int64_t state_len,
    const void *conv_w, int w_dt, const void *conv_b, int bias_dt, int64_t width, int silu,
    const void *a, const void *b, int ab_dt,                /* [T, HV] */
    const void *A_log, int alog_dt, const void *dt_bias, int dtb_dt,
    void *ssm, int ssm_dt, int64_t num_slots, int64_t ssm_slot, /* [slots, HV, K, V] */
    const int32_t *parent, const int32_t *cu, const int32_t *idx, int64_t idx_cols,
    const int32_t *num_acc, int64_t nseq,
    int64_t H, int64_t HV, int64_t K, int64_t V, float scale,
    void *out, int out_dt, float *scratch, float *gates, int32_t *tok_seq) {
  if (width < 2 || width > 64 || H <= 0 || HV % H || K <= 0 || K % 4 || V <= 0 || V % GDN_BV ||
      dim != 2 * H * K + HV * V)
    return -1;
  if (nseq && cu[0] != 0) return -2;
  const int64_t T = nseq ? cu[nseq] : 0;
  /* validate, and map every token to its sequence */
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t bos = cu[i], q = cu[i + 1] - cu[i];
    if (q < 0 || bos < 0) return -2;
    if (q == 0) continue;
    if (q > idx_cols || width - 2 + q > state_len) return -3;
    if (num_acc[i] < 1 || num_acc[i] > idx_cols || num_acc[i] - 1 + width - 1 > state_len)
      return -4;
    const int32_t *row = idx + i * idx_cols;
    if (row[0] < 0 || row[0] >= num_slots || row[num_acc[i] - 1] < 0 ||
        row[num_acc[i] - 1] >= num_slots)
      return -5;
    for (int64_t j = 0; j < q; ++j) {
      const int32_t p = parent[bos + j];
      if (j == 0 ? p != -1 : (p < 0 || p >= j)) return -6;
      if (row[j] < 0 || row[j] >= num_slots) return -5;
      tok_seq[bos + j] = (int32_t)i;
    }
  }
  const int64_t hk = K * V, group = HV / H;

  /* 1. every token's window along its path, convolved (reads the buffer
   * only); the weights and bias as fp32 [W + 1][dim] */
  float *wt = malloc((size_t)((width + 1) * dim) * sizeof(float));
  if (!wt) return -7;
  for (int64_t d = 0; d < dim; ++d) {
    for (int64_t w = 0; w < width; ++w) wt[w * dim + d] = ld_dt(conv_w, d * width + w, w_dt);
    wt[width * dim + d] = conv_b ? ld_dt(conv_b, d, bias_dt) : 0.f;
  }
  const int64_t cb_es = cb_dt ? 2 : 4;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = tok_seq[t], bos = cu[i];
    const int64_t off = num_acc[i] - 1;
    const char *slot = (const char *)conv_buf + (int64_t)idx[i * idx_cols] * cb_slot * cb_es;
    const char *src[64]; /* element d of window entry w: src[w] + d * stride[w] */
    int64_t stride[64];
    int dt[64], from_x[64];
    int contiguous = 1;
    int64_t cur = t - bos, m = width - 2;
    for (int64_t w = width - 1; w >= 0; --w) {
      from_x[w] = cur >= 0;
      if (cur >= 0) {
        src[w] = (const char *)x + (bos + cur) * dim * (x_dt ? 2 : 4);
        stride[w] = 1;
        dt[w] = x_dt;
        cur = parent[bos + cur];
      } else {
        src[w] = slot + (off + m--) * cb_col * cb_es;
        stride[w] = cb_dim;
        dt[w] = cb_dt;
        contiguous &= cb_dim == 1;
      }
    }
    float *o = scratch + t * dim;
    int64_t d = 0;
    if (contiguous) {
      for (; d + 16 <= dim; d += 16) {
        v16f acc;
        memcpy(&acc, wt + width * dim + d, sizeof acc);
        for (int64_t w = 0; w < width; ++w) {
          v16f in = load16_dt(src[w] + d * (dt[w] ? 2 : 4), dt[w]);
          if (from_x[w] && cb_dt && !x_dt) in = round_bf16x16(in);
          v16f wv;
          memcpy(&wv, wt + w * dim + d, sizeof wv);
          acc += wv * in;
        }
        if (cb_dt) acc = round_bf16x16(acc);
        if (silu) {
          acc = acc * sigmoid16(acc);
          if (cb_dt) acc = round_bf16x16(acc);
        }
        if (x_dt) acc = round_bf16x16(acc);
        memcpy(o + d, &acc, sizeof acc);
      }
    }
    for (; d < dim; ++d) {
      float acc = wt[width * dim + d];
      for (int64_t w = 0; w < width; ++w) {
        float in = ld_dt(src[w], d * stride[w], dt[w]);
        if (from_x[w]) in = round_dt(in, cb_dt);
        acc += wt[w * dim + d] * in;
      }
      acc = round_dt(acc, cb_dt);
      if (silu) acc = round_dt(acc / (1.f + expf(-acc)), cb_dt);
      o[d] = round_dt(acc, x_dt);
    }
  }
  free(wt);

  /* 2. the buffer's write-back (ascending columns: each reads a later one) */
  for (int64_t i = 0; i < nseq; ++i) {
    const int64_t bos = cu[i], q = cu[i + 1] - cu[i];
    if (q == 0) continue;
    const int64_t off = num_acc[i] - 1;
    const int64_t base = (int64_t)idx[i * idx_cols] * cb_slot;
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t c = 0; c < width - 2; ++c)
        st_dt(conv_buf, base + d * cb_dim + c * cb_col, cb_dt,
              ld_dt(conv_buf, base + d * cb_dim + (off + 1 + c) * cb_col, cb_dt));
      for (int64_t j = 0; j < q; ++j)
        st_dt(conv_buf, base + d * cb_dim + (width - 2 + j) * cb_col, cb_dt,
              ld_dt(x, (bos + j) * dim + d, x_dt));
    }
  }

  /* 3. per token and head: q, k l2-normalised (q scaled) in place in the
   * scratch row, and the value head's decay and beta */
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float *row_t = scratch + t * dim;
    for (int64_t kh = 0; kh < 2 * H; ++kh) { /* q heads, then k heads */
      float *x_h = row_t + kh * K, ss = 0.f;
      for (int64_t e = 0; e < K; ++e) ss += x_h[e] * x_h[e];
      const float r = (kh < H ? scale : 1.f) / sqrtf(ss + 1e-6f);
      for (int64_t e = 0; e < K; ++e) x_h[e] *= r;
    }
    for (int64_t hv = 0; hv < HV; ++hv) {
      const float xa = ld_dt(a, t * HV + hv, ab_dt) + ld_dt(dt_bias, hv, dtb_dt);
      const float sp = xa <= 20.f ? log1pf(expf(xa)) : xa;
      gates[2 * (t * HV + hv)] = expf(-expf(ld_dt(A_log, hv, alog_dt)) * sp);
      gates[2 * (t * HV + hv) + 1] = 1.f / (1.f + expf(-ld_dt(b, t * HV + hv, ab_dt)));
    }
  }

  /* 4. the recurrence: one task per (sequence, value head, tile of GDN_BV
   * value columns); the tile's state, K x GDN_BV fp32, stays in L1 along
   * the sequence's tokens */
  const int64_t tiles = V / GDN_BV;
  int status = 0;
#pragma omp parallel
  {
    v16f *h = aligned_alloc(64, (size_t)K * sizeof(v16f));
    if (!h) {
#pragma omp atomic write
      status = -7;
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < nseq * HV * tiles; ++task) {
      if (!h) continue;
      const int64_t i = task / (HV * tiles), hv = task / tiles % HV, v0 = task % tiles * GDN_BV;
      const int64_t kh = hv / group, bos = cu[i], q = cu[i + 1] - cu[i];
      if (q == 0) continue;
      const int32_t *row = idx + i * idx_cols;
      const int64_t es = ssm_dt ? 2 : 4;
#define GDN_TILE(slot) ((char *)ssm + ((int64_t)(slot) * ssm_slot + hv * hk + v0) * es)
      int32_t from = row[num_acc[i] - 1];
      for (int64_t j = 0; j < q; ++j) {
        const int64_t t = bos + j;
        const int32_t p = parent[t];
        if (j == 0 || p != j - 1) { /* (re)start from a stored state */
          const char *src = GDN_TILE(j == 0 ? from : row[p]);
          for (int64_t r = 0; r < K; ++r) h[r] = load16_dt(src + r * V * es, ssm_dt);
        }
        const float *qq = scratch + t * dim + kh * K;
        const float *kk = scratch + t * dim + H * K + kh * K;
        v16f vv;
        memcpy(&vv, scratch + t * dim + 2 * H * K + hv * V + v0, sizeof vv);
        const float decay = gates[2 * (t * HV + hv)], beta = gates[2 * (t * HV + hv) + 1];
        /* h *= exp(g); kv = h^T k. K is a multiple of 4: four partial sums
         * in registers, so the adds pipeline */
        v16f kv0 = {0.f}, kv1 = {0.f}, kv2 = {0.f}, kv3 = {0.f};
        for (int64_t r = 0; r < K; r += 4) {
          h[r] *= decay;
          h[r + 1] *= decay;
          h[r + 2] *= decay;
          h[r + 3] *= decay;
          kv0 += h[r] * kk[r];
          kv1 += h[r + 1] * kk[r + 1];
          kv2 += h[r + 2] * kk[r + 2];
          kv3 += h[r + 3] * kk[r + 3];
        }
        const v16f u = (vv - ((kv0 + kv1) + (kv2 + kv3))) * beta;
        v16f o0 = {0.f}, o1 = {0.f}, o2 = {0.f}, o3 = {0.f};
        char *dst = GDN_TILE(row[j]);
        for (int64_t r = 0; r < K; r += 4) { /* h += k u^T; o = h^T q */
          h[r] += kk[r] * u;
          h[r + 1] += kk[r + 1] * u;
          h[r + 2] += kk[r + 2] * u;
          h[r + 3] += kk[r + 3] * u;
          o0 += h[r] * qq[r];
          o1 += h[r + 1] * qq[r + 1];
          o2 += h[r + 2] * qq[r + 2];
          o3 += h[r + 3] * qq[r + 3];
        }
        for (int64_t r = 0; r < K; ++r) { /* the node's state stored */
          if (ssm_dt)
            store_bf16x16((uint16_t *)dst + r * V, h[r]);
          else
            memcpy((float *)dst + r * V, &h[r], sizeof(v16f));
        }
        const v16f out_v = (o0 + o1) + (o2 + o3);
        for (int e = 0; e < GDN_BV; ++e) st_dt(out, (t * HV + hv) * V + v0 + e, out_dt, out_v[e]);
      }
#undef GDN_TILE
    }
    free(h);
  }
  return status;
}
