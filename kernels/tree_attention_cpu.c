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
 * One task per (tree request, kv head): every query row of the request
 * that reads this kv head (all grouped query heads) walks the request's
 * blocks once with an online softmax in fp32, so each cache block is read
 * once per task, as vLLM's own kernel does. Plain C, built at first use by
 * kernels/cpu_native.py; the tasks run in parallel under OpenMP.
 */
#include <math.h>
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

#pragma omp parallel for collapse(2) schedule(dynamic)
  for (int64_t ti = 0; ti < num_tree_reqs; ++ti) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t r = tree_reqs[ti];
      const int64_t qs = query_start_loc[r];
      const int64_t ql = query_start_loc[r + 1] - qs;
      const int64_t seq = seq_lens[r];
      const int64_t ctx = seq - ql;
      const int64_t rows = ql * group; /* row = node * group + g */
      if (ql <= 0) continue;
      if (ctx < 0 || ql > mask_words * 32) {
#pragma omp atomic write
        status = -2;
        continue;
      }
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
        const int64_t rr = row < rows ? row : rows - 1;
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
              const int64_t node = (row < rows ? row : rows - 1) / group;
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
        const int64_t i = row / group, g = row % group;
        float *o = out + (qs + i) * o_stride_tok + (h * group + g) * o_stride_head;
        const float inv = l[row] > 0.f ? out_scale / l[row] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[row * D + d] * inv;
      }
      free(m); free(l); free(qbuf); free(acc); free(s); free(kbuf); free(vbuf);
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
