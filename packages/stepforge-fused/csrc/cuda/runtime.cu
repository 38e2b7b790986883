// SPDX-License-Identifier: Apache-2.0
//
// Runtime support: status/diagnostics, device selection, the content-keyed device table cache and scratch.
#include <climits>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>

#include "runtime.cuh"

#ifndef STEPFORGE_CUDA_ARCH_LIST
#define STEPFORGE_CUDA_ARCH_LIST "unknown"
#endif

namespace stepforge::cuda {

void throw_cuda(cudaError_t err, const char* what) {
  std::ostringstream os;
  os << "stepforge CUDA error in " << what << ": " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err)
     << ")";
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    os << "; this machine has no usable CUDA driver/device";
  } else if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorUnsupportedPtxVersion) {
    os << "; the module was built for " << STEPFORGE_CUDA_ARCH_LIST
       << " - rebuild with STEPFORGE_CUDA_ARCHS=<your SM> (e.g. 86) and a matching driver";
  }
  throw std::runtime_error(os.str());
}

// ---- diagnostics --------------------------------------------------------------------------------------------
std::vector<std::string> built_archs() {
  std::vector<std::string> out;
  std::string s = STEPFORGE_CUDA_ARCH_LIST;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t next = s.find(',', pos);
    if (next == std::string::npos) next = s.size();
    std::string a = s.substr(pos, next - pos);
    if (!a.empty()) out.push_back(a);
    pos = next + 1;
  }
  return out;
}

int device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later calls report their own state
    throw_cuda(err, "cudaGetDeviceCount");
  }
  return n;
}

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

int runtime_version() {
  int v = 0;
  check(cudaRuntimeGetVersion(&v), "cudaRuntimeGetVersion");
  return v;
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return v;
}

cudaStream_t prepare(const Launch& launch) {
  int cur = -1;
  cudaError_t err = cudaGetDevice(&cur);
  if (err != cudaSuccess || cur != launch.device) check(cudaSetDevice(launch.device), "cudaSetDevice");
  return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(launch.stream));
}

std::int64_t plan_rows(std::vector<TensorRow>& rows, const int* required, int n_required) {
  std::int64_t chunks = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    TensorRow& r = rows[i];
    if (r.numel < 0) throw std::invalid_argument("tensor " + std::to_string(i) + ": negative numel");
    for (int k = 0; k < n_required; ++k) {
      if (r.numel > 0 && r.ptr[required[k]] == 0) {
        throw std::invalid_argument("tensor " + std::to_string(i) + ": list " + std::to_string(required[k]) +
                                    " has a null data pointer");
      }
    }
    r.chunk_begin = chunks;
    chunks += (r.numel + kChunk - 1) / kChunk;
  }
  return chunks;
}

// ---- table cache --------------------------------------------------------------------------------------------
namespace {

struct CachedTable {
  std::vector<TensorRow> host;
  TensorRow* dev = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
};

struct Cache {
  std::mutex mu;
  // key: (device, stream, content hash) -> entries (collisions resolved by comparing the host copy)
  std::list<std::pair<std::tuple<int, std::uint64_t, std::uint64_t>, CachedTable>> lru;  // front = newest
  std::int64_t uploads = 0;
  static constexpr std::size_t kMax = 256;
};

Cache& cache() {
  static Cache* c = new Cache();  // leaked on purpose: no CUDA calls during interpreter teardown
  return *c;
}

std::uint64_t hash_rows(const std::vector<TensorRow>& rows) {
  const auto* w = reinterpret_cast<const std::uint64_t*>(rows.data());
  const std::size_t n = rows.size() * sizeof(TensorRow) / sizeof(std::uint64_t);
  std::uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= w[i] + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  return h;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace

const TensorRow* device_table(const std::vector<TensorRow>& rows, const Launch& launch, cudaStream_t stream) {
  Cache& c = cache();
  const std::uint64_t h = hash_rows(rows);
  const auto key = std::make_tuple(launch.device, launch.stream, h);
  const std::size_t row_bytes = rows.size() * sizeof(TensorRow);
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto it = c.lru.begin(); it != c.lru.end(); ++it) {
    if (it->first == key && it->second.host.size() == rows.size() &&
        std::memcmp(it->second.host.data(), rows.data(), row_bytes) == 0) {
      c.lru.splice(c.lru.begin(), c.lru, it);
      return c.lru.front().second.dev;
    }
  }
  if (capturing(stream)) {
    throw std::runtime_error(
        "stepforge: a multi-tensor launch met new tensor metadata during CUDA graph capture; run one eager "
        "step with the same tensors (grads allocated) on the capture stream first, e.g. "
        "torch.cuda.graph(g, stream=s) after a warm-up step under torch.cuda.stream(s)");
  }
  // Rows followed by the chunk -> row map (int32; rows are 80 bytes, so the map starts 16-byte aligned).
  std::int64_t total_chunks = 0;
  if (!rows.empty()) total_chunks = rows.back().chunk_begin + (rows.back().numel + kChunk - 1) / kChunk;
  if (rows.size() > static_cast<std::size_t>(INT32_MAX)) throw std::invalid_argument("too many tensors");
  std::vector<unsigned char> blob(row_bytes + static_cast<std::size_t>(total_chunks) * sizeof(std::int32_t));
  if (row_bytes > 0) std::memcpy(blob.data(), rows.data(), row_bytes);
  auto* map = reinterpret_cast<std::int32_t*>(blob.data() + row_bytes);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::int64_t n = (rows[i].numel + kChunk - 1) / kChunk;
    for (std::int64_t k = 0; k < n; ++k) map[rows[i].chunk_begin + k] = static_cast<std::int32_t>(i);
  }
  CachedTable t;
  t.host = rows;
  t.stream = stream;
  t.device = launch.device;
  // Stream-ordered allocation and a copy from pageable memory: the driver stages the bytes before returning,
  // so there is no host synchronisation and `blob` may be freed at once.
  const std::size_t bytes = blob.empty() ? sizeof(TensorRow) : blob.size();
  check(cudaMallocAsync(reinterpret_cast<void**>(&t.dev), bytes, stream), "cudaMallocAsync(table)");
  if (!blob.empty()) {
    check(cudaMemcpyAsync(t.dev, blob.data(), blob.size(), cudaMemcpyHostToDevice, stream), "table upload");
  }
  ++c.uploads;
  c.lru.emplace_front(key, std::move(t));
  while (c.lru.size() > Cache::kMax) {
    CachedTable& old = c.lru.back().second;
    int cur = -1;
    cudaGetDevice(&cur);
    if (cur != old.device) cudaSetDevice(old.device);
    cudaFreeAsync(old.dev, old.stream);  // ordered after every kernel already queued on that stream
    if (cur != old.device && cur >= 0) cudaSetDevice(cur);
    c.lru.pop_back();
  }
  return c.lru.front().second.dev;
}

void clear_table_cache() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [key, t] : c.lru) {
    cudaSetDevice(t.device);
    cudaFreeAsync(t.dev, t.stream);
  }
  c.lru.clear();
}

std::int64_t table_cache_size() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return static_cast<std::int64_t>(c.lru.size());
}

std::int64_t table_uploads() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.uploads;
}

void resolve_device(const std::vector<TensorRow>& rows, Launch& launch) {
  if (launch.device >= 0) return;
  for (const TensorRow& r : rows) {
    for (int l = 0; l < kMaxLists; ++l) {
      if (r.ptr[l] == 0) continue;
      cudaPointerAttributes attr{};
      check(cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(r.ptr[l]))),
            "cudaPointerGetAttributes");
      if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
        throw std::invalid_argument(
            "stepforge._cuda: a tensor pointer is not CUDA device memory (pass CUDA tensors to the CUDA module)");
      }
      launch.device = attr.device;
      return;
    }
  }
  check(cudaGetDevice(&launch.device), "cudaGetDevice");
}

// ---- scratch ------------------------------------------------------------------------------------------------
void* scratch(std::size_t bytes, const Launch& launch, cudaStream_t stream, int slot) {
  struct Buf {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mu;
  static auto* bufs = new std::map<std::tuple<int, std::uint64_t, int>, Buf>();
  std::lock_guard<std::mutex> lock(mu);
  Buf& b = (*bufs)[{launch.device, launch.stream, slot}];
  if (b.bytes >= bytes && b.ptr != nullptr) return b.ptr;
  if (capturing(stream)) {
    throw std::runtime_error(
        "stepforge: scratch memory must grow during CUDA graph capture; run one eager step first");
  }
  if (b.ptr != nullptr) check(cudaFreeAsync(b.ptr, stream), "cudaFreeAsync(scratch)");
  std::size_t want = bytes < 4096 ? 4096 : bytes + bytes / 4;
  check(cudaMallocAsync(&b.ptr, want, stream), "cudaMallocAsync(scratch)");
  b.bytes = want;
  return b.ptr;
}

}  // namespace stepforge::cuda
