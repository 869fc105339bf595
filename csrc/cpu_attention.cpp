// quant_flash_attn's torch backend on CPU in one parallel region: see qfa/attention/backends/cpu_kernel.py
// for the numerics and the contract. Built per CPU capability (the flags come from Python).
//
// Work items are (batch, kv head, query tile[, key chunk]). A worker runs its item alone: its
// GEMMs single-threaded (its register tiles, or torch's mm through host_mm), and one fused pass per
// 256-key block for max, exp, row sum, HiF8 rounding and alpha. Items are handed out by an
// atomic counter, costliest first, so a thread slowed by another process simply takes fewer
// items (on the own pool; on the OpenMP team the closing barrier still waits for it: see
// run_items). Nothing a thread computes depends on which thread runs it or how many there are.
//
// The kernel is one translation unit in parts, each a header next to this file (included here in
// dependency order, each including what it uses): kernel_config.h (the build's ISA macros and
// shared constants), hif8_rounding.h (P's HiF8 rounding, row max, exp, bf16 conversions),
// thread_scratch.h (aligned per-thread buffers), kv_decoder.h (HiF8 codes to fp32 / bf16, K / V
// addressing), gemm_tiles_fp32.h and gemm_tiles_bf16.h (the many-row blocks' register tiles),
// attention_walk.h (a call's data and one item's online-softmax walk) and parallel_region.h (the
// workers). This file keeps the entry points (kernel_api.h): forward (the call's items and its one
// region), the tests' probes and the peak measurement; cpu_attention_bindings.cpp is the Python
// module and reads the tensors.

// No ATen header (see simd_vec.h and kernel_api.h): torch's headers were half of this file's cold
// build. The tensors are read in cpu_attention_bindings.cpp, the Python module, which ninja
// compiles beside this one; it hands this file plain pointers and lengths (ForwardArgs).
#include "kernel_api.h"
#include "kernel_config.h"
#include "hif8_rounding.h"
#include "thread_scratch.h"
#include "kv_decoder.h"
#include "gemm_tiles_fp32.h"
#include "gemm_tiles_bf16.h"
#include "attention_walk.h"
#include "parallel_region.h"

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

// Decoder::init fits the decoder to its table (the affine rule, the wide and VBMI tables): about
// 2 us, a fifth of a short decode step's kernel, for a table that is the same from call to call.
// Each thread keeps the decoder it made last with what it was made from (the table's bits, the
// codes' format and QFA_VBMI, which init reads) and makes a new one when any of them differs.
const Decoder& decoder_for(const float* table, bool e4m3) {
  struct Memo {
    bool valid = false, vbmi_off = false;
    float table[256];
    Decoder dec;
  };
  thread_local Memo memo[2];  // HiF8, E4M3
  const char* off = std::getenv("QFA_VBMI");
  const bool vbmi_off = off && std::strcmp(off, "0") == 0;
  Memo& m = memo[e4m3 ? 1 : 0];
  if (!m.valid || m.vbmi_off != vbmi_off || std::memcmp(m.table, table, sizeof(m.table)) != 0) {
    m.valid = false;  // until init has returned
    m.dec.init(table, e4m3);
    std::memcpy(m.table, table, sizeof(m.table));
    m.vbmi_off = vbmi_off;
    m.valid = true;
  }
  return m.dec;
}

}  // namespace

// See qfa/attention/backends/cpu_kernel.py for the arguments; the bindings checked the tensors.
void qfa_kernel::forward(const ForwardArgs& a) {
  const int64_t heads_kv = a.heads_kv, group = a.group, dim = a.dim, block_n = a.block_n;
  const int64_t quant_mode = a.quant_mode;
  const std::vector<int64_t>&q_starts = a.q_starts, &kv_starts = a.kv_starts, &q_lens = a.q_lens,
                            &kv_lens = a.kv_lens;
  QFA_CHECK(quant_mode == 0 || quant_mode == 1 || quant_mode == 6, "quant_mode must be 0, 1 or 6");
  QFA_CHECK(dim % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  QFA_CHECK(a.round_consts.size() == 7 && a.strides.size() == 12 && a.out_strides.size() == 4 &&
            a.lse_strides.size() == 3);
#ifndef QFA_BF16_DOT
  QFA_CHECK(!a.bf16, "bf16 dot products need the AVX512_BF16 build of the kernel");
#endif
  last_paths.store(0);
  regions.store(0);
  Call c;
  c.q = a.q;
  c.k.base = a.k; c.v.base = a.v;
  for (int i = 0; i < 4; ++i) {
    c.sq[i] = a.strides[i]; c.k.st[i] = a.strides[4 + i]; c.v.st[i] = a.strides[8 + i]; c.so[i] = a.out_strides[i];
  }
  if (a.block_table) {  // paged K/V, read in place (the planner checked the table's values)
    QFA_CHECK(a.block_size > 0, "block_size must be > 0 with a block table");
    for (KvSrc* src : {&c.k, &c.v}) {
      src->table = a.block_table;
      src->table_stride = a.block_table_stride;
      src->block_size = a.block_size;
    }
  }
  c.out = a.out_bf16;
  c.out_f32 = a.out_f32;
  if (a.rotate_c != 0) {
    QFA_CHECK(dim == qfa_rows::kD && a.out_strides[3] == 1 && a.rotated_dtype >= qfa_rows::F32 &&
                  a.rotated_dtype <= qfa_rows::F16,
              "the rotated output needs head_dim ", qfa_rows::kD, ", rows contiguous along it and a float dtype");
    c.out_rot = a.out_rotated;
    c.rot_dt = static_cast<int>(a.rotated_dtype);
    c.rot_c = static_cast<float>(a.rotate_c);
  }
  c.lse = a.lse;
  for (int i = 0; i < 3; ++i) c.sl[i] = a.lse_strides[i];
  c.heads_kv = heads_kv; c.group = group; c.dim = dim; c.block_n = block_n;
  c.q_starts = q_starts; c.kv_starts = kv_starts; c.q_lens = q_lens; c.kv_lens = kv_lens;
  c.causal = a.causal;
  c.dscale = static_cast<float>(a.dscale); c.ln_p = static_cast<float>(a.ln_p);
  c.v_descale = static_cast<float>(a.v_descale);
  c.dec = decoder_for(a.decode_table, quant_mode != 0);
  c.mode = static_cast<int>(quant_mode);
  c.v_descale_h.assign(heads_kv, c.v_descale);
  if (quant_mode == 6) {
    // q_descale (Nq, Tq), k_descale (blocks, Nkv, block size) fp32 at the given strides; v per head.
    QFA_CHECK(a.q_scale_strides.size() == 2 && a.k_scale_desc.size() == 3 && a.v_descale_heads,
              "mode 6 scales: fp32 tensors and their strides");
    c.q_f32 = static_cast<const float*>(a.q_scale);
    c.k_f32 = static_cast<const float*>(a.k_scale);
    for (int i = 0; i < 2; ++i) c.q_st[i] = a.q_scale_strides[i];
    for (int i = 0; i < 3; ++i) c.kst[i] = a.k_scale_desc[i];
    c.v_descale_h.assign(a.v_descale_heads, a.v_descale_heads + heads_kv);
  } else if (quant_mode == 1) {
    // E8M0 scales as uint8: q (Tq, Nq, ceil(D/32)) at q_scale_strides; K and V in place, each
    // described by (batch or block, head, position, pos_div, pair_st, el_st, per) (KvSrc::sbase).
    QFA_CHECK(a.e8m0_table && a.q_scale_strides.size() == 2 && a.k_scale_desc.size() == 7 &&
              a.v_scale_desc.size() == 7 && a.v_scale_starts.size() == kv_starts.size(),
              "mode 1 scales: uint8 E8M0 tensors and their layout");
    QFA_CHECK(dim <= kMaxScaledDim, "mode 1: head_dim at most ", kMaxScaledDim);
    c.e8m0 = a.e8m0_table;
    c.q_e8m0 = static_cast<const uint8_t*>(a.q_scale);
    for (int i = 0; i < 2; ++i) c.q_st[i] = a.q_scale_strides[i];
    const std::vector<int64_t>* descs[2] = {&a.k_scale_desc, &a.v_scale_desc};
    const uint8_t* scales[2] = {static_cast<const uint8_t*>(a.k_scale), a.v_scale};
    KvSrc* srcs[2] = {&c.k, &c.v};
    for (int x = 0; x < 2; ++x) {
      const std::vector<int64_t>& d = *descs[x];
      KvSrc& src = *srcs[x];
      src.sbase = scales[x];
      for (int i = 0; i < 3; ++i) src.sst[i] = d[i];
      src.pos_div = d[3]; src.pair_st = d[4]; src.el_st = d[5]; src.per = d[6];
      src.e8m0 = c.e8m0;
      src.call_id = new_call_id();
      auto log2_of = [](int64_t n) {
        int k = 0;
        while ((int64_t(1) << k) < n) ++k;
        QFA_CHECK(n >= 1 && (int64_t(1) << k) == n, "mode 1: scale groups and blocks must be powers of two, got ", n);
        return k;
      };
      src.pos_shift = log2_of(src.pos_div);
      src.per_shift = log2_of(src.per);
      src.bs_shift = src.table ? log2_of(src.block_size) : 0;
    }
    c.k.sstart = c.kv_starts.data();
    c.v_scale_starts = a.v_scale_starts;
    c.v.sstart = c.v_scale_starts.data();
  }
  c.rc = round_consts_of(a.round_consts);
#ifdef QFA_SIMD
  c.panel_gemm = dim == kFusedDim && block_n % kPanel == 0;
#endif
#ifdef QFA_BF16_DOT
  c.bf16 = a.bf16 && c.panel_gemm && c.dec.simd && block_n % kBPanel == 0;
  c.bf16_few = c.bf16 && c.dec.wide;
#ifdef QFA_WIDE
  if (quant_mode == 1) {
    // MXFP8's bf16 words are scaled by moving their exponent fields: exact while a scaled value's
    // field stays below 255 (no Inf) and every product of two scaled values is a normal fp32
    // (vdpbf16ps flushes subnormals): bounds on the scale code from the table's own fields, the
    // host's MIN_BF16_E8M0 held to the lower one.
    // s = code - 127: 2 (min_field - 127 + s) >= -126 for the products, min_field + s <= 254 above
    const int low = 127 + 64 - c.dec.min_field;
    c.min_e8m0 = std::max(static_cast<int>(a.min_bf16_e8m0), low);
    c.max_e8m0 = 127 + 254 - c.dec.max_field;
  }
#endif
#endif
  const int64_t B = static_cast<int64_t>(q_lens.size());
  const int64_t T = std::max<int64_t>(1, a.tile_rows / group);  // query positions per tile

  // Work items: (batch, kv head, query tile); tiles that see no key still write their rows.
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    if (q_lens[b] == 0) continue;  // (kv_len 0: items without blocks, which write 0 / +inf)
    for (int64_t h = 0; h < heads_kv; ++h) {
      for (int64_t t0 = 0; t0 < q_lens[b]; t0 += T) {
        const int64_t t1 = std::min(q_lens[b], t0 + T);
        const int64_t ke = key_end(c, b, t1);
        const int64_t nb = ke > 0 ? (ke + block_n - 1) / block_n : 0;
        items.push_back(Item{b, h, t0, t1, 0, nb, -1, -1, double((t1 - t0) * group) * double(std::max<int64_t>(nb, 1))});
      }
    }
  }

  // K and V decoded once for batches that several tiles read (prefill), within a budget: fp32
  // (rows, or panels and slices), or bf16 panels and slices. The blocks are the region's first
  // items; an item of such a batch waits until its kv head's blocks are done (pre_left).
  std::vector<Buffer> keep;
  c.k_dec.assign(B, nullptr); c.v_dec.assign(B, nullptr); c.v_finite.assign(B, {});
  c.kb_dec.assign(B, nullptr); c.vb_dec.assign(B, nullptr);
  std::vector<int64_t> blocks;  // (b, h, block start) flattened
  std::vector<uint8_t> predecoded(B, 0);
  {
    int64_t bytes = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (q_lens[b] <= T || kv_lens[b] == 0) continue;
      const int64_t nblk_b = (kv_lens[b] + block_n - 1) / block_n;
      const int64_t per_head = (c.panel_gemm ? nblk_b * block_n : kv_lens[b]) * dim;  // panels: whole blocks
      const int64_t k_values = heads_kv * per_head;
      const int64_t elem = c.bf16 ? 2 : 4;
      const int64_t need = 2 * k_values * elem;
      if (bytes + need > a.predecode_bytes) continue;
      bytes += need;
      keep.push_back(alloc((need + 3) / 4));
      if (c.bf16) {
        c.kb_dec[b] = reinterpret_cast<uint16_t*>(keep.back().get());
        c.vb_dec[b] = c.kb_dec[b] + k_values;
      } else {
        c.k_dec[b] = keep.back().get();
        c.v_dec[b] = c.k_dec[b] + k_values;
      }
      predecoded[b] = 1;
      c.v_finite[b].assign(heads_kv * nblk_b, 0);
      for (int64_t h = 0; h < heads_kv; ++h)
        for (int64_t j0 = 0; j0 < kv_lens[b]; j0 += block_n) blocks.insert(blocks.end(), {b, h, j0});
    }
  }
  const int64_t n_pre = static_cast<int64_t>(blocks.size()) / 3;
  std::unique_ptr<std::atomic<int64_t>[]> pre_left(new std::atomic<int64_t>[std::max<int64_t>(B * heads_kv, 1)]);
  for (int64_t x = 0; x < B * heads_kv; ++x)
    pre_left[x].store(predecoded[x / heads_kv] ? (kv_lens[x / heads_kv] + block_n - 1) / block_n : 0,
                      std::memory_order_relaxed);
  std::atomic<bool> pre_failed{false};
  auto predecode = [&](int64_t i, Scratch& sc) {
    const int64_t b = blocks[3 * i], h = blocks[3 * i + 1], j0 = blocks[3 * i + 2];
    // Counted down on every exit (flagged first if it threw): the items waiting for it go on.
    struct Done {
      std::atomic<int64_t>& left;
      std::atomic<bool>& failed;
      bool ok = false;
      ~Done() {
        if (!ok) failed.store(true);
        left.fetch_sub(1, std::memory_order_release);
      }
    } done{pre_left[b * heads_kv + h], pre_failed};
    const int64_t j1 = std::min(j0 + block_n, kv_lens[b]);
    const int64_t nblk_b = (kv_lens[b] + block_n - 1) / block_n;
    const int64_t off = (h * kv_lens[b] + j0) * dim;
    uint8_t& finite = c.v_finite[b][h * nblk_b + j0 / block_n];
    sc.ensure(1, dim, block_n);
#ifdef QFA_BF16_DOT
    if (c.bf16) {
      const int64_t at_ = (h * nblk_b + j0 / block_n) * block_n * dim;
      decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, sc.half(sc.kb));
      to_bpanels(sc.half(sc.kb), j1 - j0, c.kb_dec[b] + at_);
      finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, sc.half(sc.vb));
      to_bslices(sc.half(sc.vb), j1 - j0, c.vb_dec[b] + at_, block_n * kBPanel);
      done.ok = true;
      return;
    }
#endif
#ifdef QFA_SIMD
    if (c.panel_gemm) {
      const int64_t at_ = (h * nblk_b + j0 / block_n) * block_n * dim;
      decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, sc.k.get());
      to_panels(sc.k.get(), j1 - j0, c.k_dec[b] + at_);
      finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, sc.v.get());
      to_slices(sc.v.get(), j1 - j0, c.v_dec[b] + at_, block_n * kPanel);
      done.ok = true;
      return;
    }
#endif
    decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, c.k_dec[b] + off);
    finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, c.v_dec[b] + off);
    done.ok = true;
  };
  // Before an item reads its batch's decoded K / V: every block of its kv head done. The blocks
  // are handed out before any other item, so this waits only for blocks already being decoded.
  auto wait_predecoded = [&](const Item& it) {
    if (!predecoded[it.b]) return;
    const std::atomic<int64_t>& left = pre_left[it.b * heads_kv + it.h];
    for (int spins = 0; left.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 64) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    QFA_CHECK(!pre_failed.load(), "qfa native attention: decoding K / V for the call failed");
  };

  // Items of few rows (decode: a few new tokens x the GQA group) split their keys into chunks
  // of whole blocks. The split depends only on the item's own shape: never on the thread count,
  // nor on the other batches of the call (a batch gives the same bits alone or with others).
  std::vector<Item> whole, chunks;
  std::vector<int64_t> chunk_begin;  // per split item: its first chunk; chunks of an item are contiguous
  std::vector<Item> split_items;
  for (const Item& it : items) {
    const int64_t nb = it.c1 - it.c0;
    const int64_t rows = (it.t1 - it.t0) * group;
    const int64_t n = rows <= a.split_rows && a.chunk_blocks > 0 ? (nb + a.chunk_blocks - 1) / a.chunk_blocks : 1;
    if (n <= 1) { whole.push_back(it); continue; }
    chunk_begin.push_back(static_cast<int64_t>(chunks.size()));
    split_items.push_back(it);
    for (int64_t x = 0; x < n; ++x) {
      Item ch = it;
      ch.c0 = it.c0 + nb * x / n;
      ch.c1 = it.c0 + nb * (x + 1) / n;
      ch.slot = static_cast<int64_t>(chunks.size());
      ch.first = chunk_begin.back();
      ch.cost = double((it.t1 - it.t0) * group) * double(ch.c1 - ch.c0);
      chunks.push_back(ch);
    }
  }

  // Split items, pass 1: each chunk's contribution to the running max.
  std::vector<std::vector<float>> cmax(chunks.size());
  // A chunk's pass 1 keeps its scores for its pass 2 when they fit the budget: in the scratch of
  // the thread that runs both (see work below), which the thread keeps from call to call (decode
  // calls come one per token: no fresh pages to fault in) and where a chunk's scores (a few
  // hundred KB at most) are still in L2 for pass 2. Over the budget, pass 2 computes them again.
  auto keeps = [&](const Item& ch) {
    return (ch.t1 - ch.t0) * group * (ch.c1 - ch.c0) * block_n * 4 <= a.store_bytes;
  };
  // One region for the call: the blocks to decode first, then the items, a split item as its
  // chunks in order (see work below), so whatever an item waits for (its decoded blocks, the
  // earlier chunks' pass 1) is handed out before it and already running on another thread or
  // done (never an item not yet taken: no deadlock, and one thread runs them in order). Prefill
  // tiles, decode chunks and the blocks they wait for share one counter: a mixed batch (chunked
  // prefill beside decodes) is balanced over the threads as one piece of work. A chunk starts
  // from the running max the sequential walk has before its first block: the max of the earlier
  // chunks' maxima.
  std::unique_ptr<std::atomic<int>[]> max_done(new std::atomic<int>[chunks.size() + 1]);
  for (size_t x = 0; x < chunks.size(); ++x) max_done[x].store(0, std::memory_order_relaxed);
  std::vector<Partial> parts(chunks.size());
  // The order items are handed out in: the blocks to decode, then whole items and split items
  // costliest first, a split item as its chunks in key order. A chunk is one piece of work: its
  // pass 1, then (once the earlier chunks' pass 1 is done: they were handed out before it) its
  // pass 2 on the same thread, which finds the chunk's K codes and kept scores still in its
  // caches. (Pass 1 of every chunk before any pass 2 kept all the scores at once: 3 MB at Sq =
  // 16, B = 1, Skv = 4096, out of L2, and the QK^T tiles stalled writing them.)
  struct Work {
    int kind;     // 0: decode a K/V block, 1: a chunk (pass 1, then pass 2), 2: a whole item
    int64_t idx;  // into blocks / chunks / whole
  };
  std::vector<Work> work;
  work.reserve(n_pre + whole.size() + chunks.size());
  for (int64_t i = 0; i < n_pre; ++i) work.push_back({0, i});
  {
    std::vector<Item> units = whole;  // (cost, and which: whole item w, or split item s as -1 - s)
    std::vector<int64_t> which(whole.size());
    for (size_t w = 0; w < whole.size(); ++w) which[w] = static_cast<int64_t>(w);
    for (size_t x = 0; x < split_items.size(); ++x) {
      units.push_back(split_items[x]);
      which.push_back(-1 - static_cast<int64_t>(x));
    }
    for (int64_t u : by_cost(units)) {
      const int64_t w = which[u];
      if (w >= 0) {
        work.push_back({2, w});
        continue;
      }
      const size_t x = static_cast<size_t>(-1 - w);
      const int64_t first = chunk_begin[x];
      const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
      for (int64_t y = first; y < last; ++y) work.push_back({1, y});
    }
  }
  // Merge the chunks of split item s in chunk order: l = l * prod_k + l_k, O = O * prod_k + O_k,
  // where prod_k is the product of chunk k's alphas (the sequential walk applies them one by
  // one). Run inside the region by whichever thread finishes the item's last chunk (chunks_left):
  // the order, and so every bit, is the same whatever thread that is.
  std::vector<int64_t> split_of(chunks.size());
  std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[split_items.size() + 1]);
  for (size_t x = 0; x < split_items.size(); ++x) {
    const int64_t first = chunk_begin[x];
    const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
    for (int64_t y = first; y < last; ++y) split_of[y] = static_cast<int64_t>(x);
    chunks_left[x].store(last - first, std::memory_order_relaxed);
  }
  auto merge = [&](size_t x) {
    const Item& it = split_items[x];
    const int64_t R = (it.t1 - it.t0) * group;
    const int64_t first = chunk_begin[x];
    const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
    Partial acc = parts[first];
    for (int64_t y = first + 1; y < last; ++y) {
      const Partial& p = parts[y];
      for (int64_t r = 0; r < R; ++r) {
        const float a = p.prod[r];
        acc.l[r] = acc.l[r] * a + p.l[r];
        for (int64_t d = 0; d < dim; ++d) acc.o[r * dim + d] = acc.o[r * dim + d] * a + p.o[r * dim + d];
      }
      acc.m = p.m;
    }
    std::vector<float> logl(R);
    finish(c, it, acc.m.data(), acc.l.data(), acc.o.data(), logl.data());
  };
  run_items(static_cast<int64_t>(work.size()), a.threads, a.nested, [&](int64_t i, Scratch& sc) {
    const Work wk = work[i];
    if (wk.kind == 0) {
      predecode(wk.idx, sc);
      return;
    }
    const Item& it = wk.kind == 2 ? whole[wk.idx] : chunks[wk.idx];
    const int64_t R = (it.t1 - it.t0) * group;
    float* kept = nullptr;  // a chunk's scores from its pass 1, for its pass 2
    {
      // A chunk's pass 1 is marked done on every exit, 2 if anything up to its end threw (the
      // scratch, Q, the decoded blocks it waits for): the later chunks must not wait for it forever.
      struct Mark {
        std::atomic<int>* done;
        int value = 2;
        ~Mark() {
          if (done) done->store(value, std::memory_order_release);
        }
      } mark{wk.kind == 1 ? &max_done[wk.idx] : nullptr};
      sc.ensure(R, dim, block_n);
      load_q(c, it, sc);
      wait_predecoded(it);
      if (wk.kind == 1) {
        if (keeps(it)) kept = sc.keep((it.c1 - it.c0) * R * block_n);
        cmax[wk.idx].assign(R, kNegInf);
        chunk_max(c, it, sc, cmax[wk.idx].data(), kept);
        mark.value = 1;
      }
    }
    float* m = sc.m.get();
    for (int64_t r = 0; r < R; ++r) m[r] = kNegInf;
    if (it.slot >= 0) {
      // The earlier chunks' maxima (their pass 1 was handed out before this chunk).
      for (int64_t x = it.first; x < it.slot; ++x) {
        for (int spins = 0; !max_done[x].load(std::memory_order_acquire); ++spins) {
          if (spins < 64) {
            cpu_relax();
          } else {
            std::this_thread::yield();  // under load the thread we wait for may need this core
          }
        }
        QFA_CHECK(max_done[x].load(std::memory_order_acquire) == 1, "qfa native attention: an earlier chunk failed");
        for (int64_t r = 0; r < R; ++r) m[r] = max_nan(m[r], cmax[x][r]);
      }
    }
    walk(c, it, sc, kept);
    if (it.slot < 0) {
      finish(c, it, m, sc.l.get(), sc.o.get(), sc.alpha.get());
    } else {
      Partial& p = parts[it.slot];
      p.m.assign(m, m + R); p.l.assign(sc.l.get(), sc.l.get() + R);
      p.prod.assign(sc.prod.get(), sc.prod.get() + R); p.o.assign(sc.o.get(), sc.o.get() + R * dim);
      const int64_t x = split_of[it.slot];
      if (chunks_left[x].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(static_cast<size_t>(x));
    }
  });
}

namespace {
// The tests' decoder for a table: the kernel's, or (simd false) its scalar lookups alone.
Decoder probe_decoder(const float* decode_table, bool e4m3, bool simd) {
  Decoder dc;
  dc.init(decode_table, e4m3);
  dc.simd = dc.simd && simd;
#ifdef QFA_WIDE
  dc.wide = dc.wide && simd;
  dc.vbmi = dc.vbmi && simd;
#endif
  return dc;
}
}  // namespace

// The kernel's decoder on its own, for the tests: fp32 values of n codes into out (the SIMD body
// and the scalar tail both run), and whether all are finite; e4m3: its E4M3 form (modes 1, 6).
bool qfa_kernel::decode_codes(const uint8_t* codes, int64_t n, const float* decode_table, bool simd, bool e4m3,
                              float* out) {
  return probe_decoder(decode_table, e4m3, simd).decode(codes, 1, out, n);
}

// The same to bf16 words (the bf16 dot products' operands).
bool qfa_kernel::decode_codes_bf16(const uint8_t* codes, int64_t n, const float* decode_table, bool simd, bool e4m3,
                                   uint16_t* out) {
  return probe_decoder(decode_table, e4m3, simd).decode_bf16(codes, 1, out, n);
}

// Which form of the decoder runs for this table here (tests): "vbmi" (the byte lookups), "wide"
// (the AVX-512 word lookups), "simd" (the AVX2 rule / fp16 route) or "scalar".
std::string qfa_kernel::decoder_kind(const float* decode_table, bool e4m3) {
  Decoder dc;
  dc.init(decode_table, e4m3);
#ifdef QFA_WIDE
  if (dc.vbmi) return "vbmi";
  if (dc.wide) return "wide";
#endif
  return dc.simd ? "simd" : "scalar";
}

// Whether the SIMD decoder runs for this table in this build.
bool qfa_kernel::simd_decoder(const float* decode_table, bool e4m3) {
  Decoder dc;
  dc.init(decode_table, e4m3);
  return dc.simd;
}

// The kernel's HiF8 rounding of P on its own, for the tests: x rounded in place (the 8-lane body
// and the scalar tail, or the scalar rule alone).
// The few-row S's sums of 16 dot products' 16 lanes each (x: 16 rows of 16 lanes), as the
// build's kernels take them: side by side (tree_sums16) in the AVX512_BF16 build, one by one
// (Lanes16::fold, hsum8) in the AVX-512 one. False where S has no 16-lane sums (AVX2 builds).
bool qfa_kernel::dot_sums16(const float* x, float* out) {
#if defined(QFA_BF16_DOT)
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_loadu_ps(x + 16 * i);
  _mm512_storeu_ps(out, tree_sums16(a));
  return true;
#elif defined(QFA_WIDE)
  __m256 f[16];
  for (int i = 0; i < 16; ++i) f[i] = Lanes16::fold(_mm512_loadu_ps(x + 16 * i));
  for (int h = 0; h < 16; h += 8)
    _mm256_storeu_ps(out + h, hsum8(f[h], f[h + 1], f[h + 2], f[h + 3], f[h + 4], f[h + 5], f[h + 6], f[h + 7]));
  return true;
#else
  (void)x;
  (void)out;
  return false;
#endif
}

// The bf16 dot products' rounding of P (AVX512_BF16 builds): x rounded in place by
// round_sum_to_bf16 (keep) in a row padded past its n values, as the walk's causal rows are: the
// pad's words and floats must come back zero, what lies past it untouched, and the fp32 result
// must be the bf16 copy.
namespace {
template <bool E4M3>
void round_p_bf16(float* x, int64_t n, const RoundConsts& rc) {
#ifdef QFA_BF16_DOT
  const int64_t n_pad = (n + 41) & ~int64_t(1), tail = 64;
  std::vector<float> row(x, x + n);
  row.resize(n_pad + tail, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint16_t> half(n_pad + tail, 0xFFFF);
  round_sum_to_bf16<E4M3>(row.data(), n, n_pad, rc, half.data(), true);
  for (int64_t j = 0; j < n_pad + tail; ++j) {
    uint32_t got;
    std::memcpy(&got, row.data() + j, 4);
    if (j < n_pad) {
      QFA_CHECK(got == uint32_t(half[j]) << 16, "round_sum_to_bf16: its bf16 copy differs from its fp32 result at ", j);
      QFA_CHECK(j < n || got == 0, "round_sum_to_bf16: the pad is not zero at ", j);
    } else {
      QFA_CHECK(half[j] == 0xFFFF && std::isnan(row[j]), "round_sum_to_bf16: wrote past the pad at ", j);
    }
  }
  std::memcpy(x, row.data(), sizeof(float) * n);
#else
  (void)x; (void)n; (void)rc;
  QFA_CHECK(false, "bf16: needs the AVX512_BF16 build");
#endif
}
}  // namespace

// The kernel's roundings of P on their own (tests): 32 / 16 / 8 lanes and the scalar tail, or the
// scalar rule alone (simd false); bf16: the bf16 dot products' rounding, its fp32 result.
void qfa_kernel::round_p(float* x, int64_t n, const std::vector<int64_t>& round_consts, bool simd, bool bf16) {
  const RoundConsts rc = round_consts_of(round_consts);
  if (bf16) return round_p_bf16<false>(x, n, rc);
  round_row(x, n, rc, simd);
}

void qfa_kernel::round_p_e4m3(float* x, int64_t n, bool simd, bool bf16) {
  if (bf16) return round_p_bf16<true>(x, n, RoundConsts{});  // (E4M3 reads none of them)
  round_row_e4m3(x, n, simd);
}

// The width of the build's fp32 vectors: head dims must be a multiple of it.
int64_t vec_width() { return Vec::size(); }

// The team of the last region a call ran, and how many threads entered it (tests).
std::tuple<std::string, int64_t> last_region() {
  static const char* names[] = {"caller", "own", "omp"};
  return {names[last_team.load()], last_team.load() == 2 ? last_entered.load() : -1};
}

// The kernels the last call's blocks ran, by name (the bench's ISA column; tests).
std::vector<std::string> last_paths_names() {
  const int bits = last_paths.load();
  std::vector<std::string> names;
  if (bits & kPathBf16) names.push_back("AVX512_BF16");
  if (bits & kPathAvx2) names.push_back("AVX2");
  if (bits & kPathScalar) names.push_back("scalar");
  if (bits & kPathAvx512) names.push_back("AVX512");
  return names;
}

// How many parallel regions the last call ran (tests: one, whatever the batch holds).
int64_t last_regions() { return regions.load(); }

// Whether this build has the bf16 dot-product kernels.
bool has_bf16_dot() {
#ifdef QFA_BF16_DOT
  return true;
#else
  return false;
#endif
}

// ---- the CPU's peak, measured: independent FMA (or bf16 dot) chains in registers ---------------
// Twelve accumulators per thread (more than latency x throughput on the CPUs here), each from its
// own start value: chains that start equal are one chain to the optimiser (the bf16 loop's twelve
// zero-started chains compiled to one latency-bound chain, counted twelve times: the bench
// reported about 2x the instruction's real rate as the peak). On `threads` threads at once, each
// for about `seconds` of its own CPU time, in windows of kPeakWindow; returns the sum over threads
// of each thread's best window rate (an FMA is 2 FLOP, a bf16 dot step 4 per lane). Kinds:
// peak_kinds().
// Why CPU time: another process time-sharing the cores must not lower it (wall time would: the
// bench's first tables showed rows "above" a peak measured beside a busy process).
// Why windows and the best of them: on a shared KVM guest, host work still shows on the guest's
// thread clock (host time its steal accounting misses, an SMT sibling on the host sharing the
// core's FMA units), in stretches of milliseconds up to much of the probe. One rate over the whole
// run took them in: three runs on the Zen 3 EPYC guest within 5 minutes read 180, 203 and 104
// GFLOP/s, and rows then showed "141 % of peak". Such work only ever slows a window, so the fastest
// window is the one nearest the hardware's rate, and it survives a slow stretch of any length
// short of the whole probe, where the 90th percentile would fall once a tenth of the windows were
// slow. Its upward error is small (each window holds 10+ steps of ~0.1-0.2 ms on a nanosecond
// clock; on a quiet run the best window read 1.5 % above the whole run's rate), and the peak is a
// bound the rows are a share of: a little high is harmless, low made rows exceed it.
inline double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

constexpr double kPeakWindow = 2e-3;  // seconds of thread CPU time per window

template <typename Step>
double time_chains(int64_t threads, double seconds, double flop_per_step, const Step& step) {
  std::vector<double> best(threads, 0.0);
  std::vector<std::thread> team;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(20 * seconds);
  const double window = std::min(kPeakWindow, seconds);
  for (int64_t t = 0; t < threads; ++t) {
    team.emplace_back([&, t] {
      step();  // warm up (clocks, caches)
      const double t0 = thread_cpu_seconds();
      double rate = 0;
      do {
        const double w0 = thread_cpu_seconds();
        int64_t n = 0;
        double used = 0;
        do {
          n += step();
          used = thread_cpu_seconds() - w0;
        } while (used < window);
        rate = std::max(rate, double(n) * flop_per_step / used / 1e9);
      } while (thread_cpu_seconds() - t0 < seconds && std::chrono::steady_clock::now() < give_up);
      best[t] = rate;
    });
  }
  for (auto& t : team) t.join();
  double sum = 0;
  for (double r : best) sum += r;
  return sum;
}

static thread_local volatile float peak_sink = 0.f;

#define QFA_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
constexpr int64_t kPeakInner = 1 << 16;

std::vector<std::string> peak_kinds() {
  std::vector<std::string> kinds;
#ifdef QFA_SIMD
  kinds.push_back("fp32_avx2");
#endif
#ifdef CPU_CAPABILITY_AVX512
  kinds.push_back("fp32_avx512");
#endif
#ifdef QFA_BF16_DOT
  kinds.push_back("bf16_dot");
#endif
  return kinds;
}

double peak_gflops(const std::string& kind, int64_t threads, double seconds) {
  QFA_CHECK(threads >= 1 && seconds > 0, "peak_gflops: threads >= 1 and seconds > 0");
#ifdef QFA_SIMD
  if (kind == "fp32_avx2") {
    return time_chains(threads, seconds, 12.0 * 8 * 2 * kPeakInner, [] {
#define QFA_D(i) __m256 a##i = _mm256_set1_ps(0.001f * i);
      QFA_R12(QFA_D)
      const __m256 m = _mm256_set1_ps(0.999999f), x = _mm256_set1_ps(1e-7f);
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_F(i) a##i = _mm256_fmadd_ps(a##i, m, x);
        QFA_R12(QFA_F)
      }
      __m256 sum = _mm256_setzero_ps();
#define QFA_S(i) sum = _mm256_add_ps(sum, a##i);
      QFA_R12(QFA_S)
      alignas(32) float o[8];
      _mm256_store_ps(o, sum);
      peak_sink = o[0];  // keeps the chains live
      return int64_t(1);
    });
  }
#endif
#ifdef CPU_CAPABILITY_AVX512
  if (kind == "fp32_avx512") {
    return time_chains(threads, seconds, 12.0 * 16 * 2 * kPeakInner, [] {
#define QFA_D5(i) __m512 a##i = _mm512_set1_ps(0.001f * i);
      QFA_R12(QFA_D5)
      const __m512 m = _mm512_set1_ps(0.999999f), x = _mm512_set1_ps(1e-7f);
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_F5(i) a##i = _mm512_fmadd_ps(a##i, m, x);
        QFA_R12(QFA_F5)
      }
      __m512 sum = _mm512_setzero_ps();
#define QFA_S5(i) sum = _mm512_add_ps(sum, a##i);
      QFA_R12(QFA_S5)
      peak_sink = _mm512_reduce_add_ps(sum);
      return int64_t(1);
    });
  }
#endif
#ifdef QFA_BF16_DOT
  if (kind == "bf16_dot") {
    return time_chains(threads, seconds, 12.0 * 32 * 2 * kPeakInner, [] {
#define QFA_DB(i) __m512 a##i = _mm512_set1_ps(0.001f * i); asm("" : "+v"(a##i));
      QFA_R12(QFA_DB)
      const __m512bh x = as_bh(_mm512_set1_epi16(0x3F80)), y = as_bh(_mm512_set1_epi16(0x3400));
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_FB(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
        QFA_R12(QFA_FB)
      }
      __m512 sum = _mm512_setzero_ps();
      QFA_R12(QFA_S5)
      peak_sink = _mm512_reduce_add_ps(sum);
      return int64_t(1);
    });
  }
#endif
  check_failed("false", "peak_gflops: kind must be one of this build's peak_kinds(), got '", kind, "'");
}
