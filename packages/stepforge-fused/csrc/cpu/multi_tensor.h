// SPDX-License-Identifier: Apache-2.0
// The parallel loop of every CPU kernel: the concatenated element range of all tensors cut into chunks (not
// per tensor), handed out dynamically to OpenMP threads, and deterministic per-(chunk, tensor) partial sums.
// Included only by the per-ISA kernel files (internal linkage, see convert.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu/kernels.h"

#ifndef STEPFORGE_ISA_NS
#error "STEPFORGE_ISA_NS must name the ISA copy (scalar, avx2, avx512)"
#endif

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

constexpr int64_t kBlock = 512;             // elements per conversion block (2 KiB of float temporaries)
constexpr int64_t kMinParallel = 1 << 15;   // below this many elements, one thread beats a parallel region
constexpr int64_t kAlign = 64;              // thread ranges start on multiples of 64 elements (cache lines)

// ---- parallel loop over the concatenated element range ---------------------------------------------------
// The range [0, total) is cut into chunks (a few per thread, multiples of 64 elements) handed out dynamically,
// so a thread slowed down by another process does not hold up the others. f(chunk, tensor, begin, end) with
// [begin, end) local to the tensor. Chunk boundaries depend only on (total, threads), so reductions that keep
// one partial per (chunk, tensor) and combine them in chunk order are deterministic.
struct Chunks {
  int64_t total = 0;
  int64_t size = 0;
  int64_t count = 0;
  int threads = 1;
};

inline Chunks make_chunks(const MultiTensor& mt) {
  Chunks c;
  c.total = mt.n > 0 ? mt.offsets[mt.n] : 0;
  c.threads = (c.total < kMinParallel || mt.num_threads < 1) ? 1 : mt.num_threads;
  const int64_t pieces = c.threads == 1 ? 1 : int64_t(c.threads) * 4;
  int64_t size = (c.total + pieces - 1) / pieces;
  if (c.threads > 1) size = std::max<int64_t>(size, kMinParallel / 2);
  size = (size + kAlign - 1) / kAlign * kAlign;
  c.size = std::max<int64_t>(size, kAlign);
  c.count = c.total == 0 ? 0 : (c.total + c.size - 1) / c.size;
  return c;
}

inline int64_t first_tensor(const MultiTensor& mt, int64_t pos) {
  return int64_t(std::upper_bound(mt.offsets, mt.offsets + mt.n + 1, pos) - mt.offsets) - 1;
}

template <class F>
void run_chunk(const MultiTensor& mt, const Chunks& c, int64_t chunk, F& f) {
  const int64_t b = chunk * c.size;
  const int64_t e = std::min(c.total, b + c.size);
  int64_t t = first_tensor(mt, b);
  int64_t pos = b;
  while (pos < e && t < mt.n) {
    const int64_t seg_end = std::min(e, mt.offsets[t + 1]);
    if (seg_end > pos) f(chunk, t, pos - mt.offsets[t], seg_end - mt.offsets[t]);
    pos = std::max(pos, seg_end);
    ++t;
  }
}

template <class F>
void parallel_segments(const MultiTensor& mt, F&& f) {
  const Chunks c = make_chunks(mt);
  if (c.count == 0) return;
#if defined(_OPENMP)
  if (c.threads > 1 && c.count > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(c.threads)
    for (int64_t chunk = 0; chunk < c.count; ++chunk) run_chunk(mt, c, chunk, f);
    return;
  }
#endif
  for (int64_t chunk = 0; chunk < c.count; ++chunk) run_chunk(mt, c, chunk, f);
}

// Per-(chunk, tensor) partial sums, combined in chunk order (deterministic for a given thread count).
class ChunkPartials {
 public:
  ChunkPartials(const MultiTensor& mt, int width) : n_(mt.n), width_(width) {
    const Chunks c = make_chunks(mt);
    first_.resize(size_t(c.count));
    base_.assign(size_t(c.count) + 1, 0);
    for (int64_t k = 0; k < c.count; ++k) {
      const int64_t b = k * c.size;
      const int64_t e = std::min(c.total, b + c.size);
      const int64_t t0 = first_tensor(mt, b);
      const int64_t t1 = first_tensor(mt, e - 1);
      first_[size_t(k)] = t0;
      base_[size_t(k) + 1] = base_[size_t(k)] + (t1 - t0 + 1);
    }
    data_.assign(size_t(base_.back()) * size_t(width), 0.0);
  }
  double* at(int64_t chunk, int64_t t) {
    return &data_[size_t(base_[size_t(chunk)] + (t - first_[size_t(chunk)])) * size_t(width_)];
  }
  // out[t * width + w] = sum over chunks, in order, of tensor t's partials.
  void combine(double* out) const {
    for (int64_t i = 0; i < n_ * width_; ++i) out[i] = 0.0;
    for (size_t k = 0; k < first_.size(); ++k)
      for (int64_t j = base_[k]; j < base_[k + 1]; ++j) {
        const int64_t t = first_[k] + (j - base_[k]);
        for (int w = 0; w < width_; ++w) out[t * width_ + w] += data_[size_t(j) * size_t(width_) + size_t(w)];
      }
  }

 private:
  int64_t n_;
  int width_;
  std::vector<int64_t> first_;
  std::vector<int64_t> base_;
  std::vector<double> data_;
};

}  // namespace
}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
