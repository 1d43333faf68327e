// sgl_kernel_ext: copy kernels for the hybrid prefix cache (docs/kernel-ext.md).
//
// Three ops, each one launch on the caller's stream:
//   - kv blocks <-> staging: any set of 64-token blocks (one token-slot list per block) of every
//     attention K/V buffer to / from one contiguous staging buffer laid out as the host slab's
//     block bundle (store/layout.py), in vectors of up to 16 bytes;
//   - state taps: per-chunk recurrent states h -> SSM pool slots, with dtype conversion;
//   - conv taps: the conv window (last W pre-convolution inputs) at a tap position -> conv pool
//     slots, the part before the pass start taken from the request's incoming conv state.
//
// Deliberately free of libtorch: the library exports a C ABI (loaded with ctypes, registered as
// torch ops from Python), so one binary serves any torch/Python built against CUDA 13's runtime.
// Every argument was validated by the Python wrapper; these functions only launch.
//
// Conversions use the CUDA intrinsics c10::Half / c10::BFloat16 use on the device
// (__float2half, __float2bfloat16: round to nearest even), so a converted value is bit-identical
// to torch's Tensor.to() on CUDA. Same-dtype copies move raw bits.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define SGL_KEXT_ABI_VERSION 1
#define MAX_LAYERS 64   // per launch; the wrapper launches again for more
#define MAX_BUFFERS 64  // K and V buffers per launch (32 attention layers)

enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// ------------------------------------------------------------------------------------ helpers
template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static __device__ __forceinline__ float to_f(float x) { return x; }
  static __device__ __forceinline__ float from_f(float x) { return x; }
};
template <>
struct Conv<__half> {
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half(x); }
};
template <>
struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16(x); }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

static int grid_x_for(int64_t work, int threads, int cap) {
  int64_t g = (work + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > cap) g = cap;
  return (int)g;
}

static int grid_y_for(int64_t rows, int gx, int max_ctas) {
  int64_t g = max_ctas / gx;
  if (g < 1) g = 1;
  if (g > rows) g = rows;
  if (g > 65535) g = 65535;
  return (int)g;
}

// ------------------------------------------------------------------ kv blocks <-> staging
struct KvParams {
  int64_t buf_ptr[MAX_BUFFERS];     // base address of each K/V buffer
  int64_t row_stride[MAX_BUFFERS];  // bytes between token slots
  int64_t row_bytes[MAX_BUFFERS];   // bytes of one token row
  int64_t plane_off[MAX_BUFFERS];   // byte offset of the buffer's plane in a bundle
  int n_buf;
  int rows;               // token rows per block (64, fewer for a tail)
  int64_t n_blocks;
  const int64_t* slots;   // [n_blocks, rows] token slots, on the device
  int64_t staging;        // base address of the staging buffer
  int64_t pitch;          // bytes between blocks in staging
};

template <typename V, bool TO_STAGING>
__global__ void kv_copy_kernel(const __grid_constant__ KvParams p) {
  const int64_t pairs = p.n_blocks * p.n_buf;
  for (int64_t pair = blockIdx.y; pair < pairs; pair += gridDim.y) {
    const int64_t b = pair / p.n_buf;
    const int k = (int)(pair - b * p.n_buf);
    char* const buf = reinterpret_cast<char*>(p.buf_ptr[k]);
    const int64_t rs = p.row_stride[k];
    const uint32_t vpr = (uint32_t)(p.row_bytes[k] / (int64_t)sizeof(V));
    const uint32_t nv = vpr * (uint32_t)p.rows;
    char* const plane = reinterpret_cast<char*>(p.staging) + b * p.pitch + p.plane_off[k];
    const int64_t* const sl = p.slots + b * p.rows;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += gridDim.x * blockDim.x) {
      const uint32_t r = i / vpr;
      const uint32_t v = i - r * vpr;
      V* dev = reinterpret_cast<V*>(buf + sl[r] * rs) + v;
      V* stg = reinterpret_cast<V*>(plane) + i;  // the plane's rows are back to back
      if (TO_STAGING) {
        *stg = *dev;
      } else {
        *dev = *stg;
      }
    }
  }
}

template <typename V>
static void launch_kv(const KvParams& p, bool to_staging, int max_ctas, cudaStream_t s) {
  int64_t max_vecs = 0;
  for (int k = 0; k < p.n_buf; ++k) {
    const int64_t nv = p.row_bytes[k] / (int64_t)sizeof(V) * p.rows;
    if (nv > max_vecs) max_vecs = nv;
  }
  const int threads = 256;
  const int gx = grid_x_for(max_vecs, threads, 32);
  const dim3 grid(gx, grid_y_for(p.n_blocks * p.n_buf, gx, max_ctas));
  if (to_staging) {
    kv_copy_kernel<V, true><<<grid, threads, 0, s>>>(p);
  } else {
    kv_copy_kernel<V, false><<<grid, threads, 0, s>>>(p);
  }
}

// ------------------------------------------------------------------------- state taps
struct StateParams {
  int64_t src[MAX_LAYERS];  // per layer: base address of h
  int64_t dst[MAX_LAYERS];  // per layer: base address of the pool's layer
  int n_layers;
  int64_t n_taps;
  const int64_t* taps;  // [n_taps, 2] (source element offset, destination element offset)
  int64_t row;          // elements of one state (H*V*K), in units of the packs below
};

// Same dtype: raw bits in vectors V (row counted in V units, offsets in V units).
template <typename V>
__global__ void state_raw_kernel(const __grid_constant__ StateParams p) {
  const int64_t rows = p.n_taps * p.n_layers;
  for (int64_t rr = blockIdx.y; rr < rows; rr += gridDim.y) {
    const int l = (int)(rr / p.n_taps);
    const int64_t t = rr - (int64_t)l * p.n_taps;
    const V* src = reinterpret_cast<const V*>(p.src[l]) + p.taps[2 * t];
    V* dst = reinterpret_cast<V*>(p.dst[l]) + p.taps[2 * t + 1];
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p.row;
         i += (int64_t)gridDim.x * blockDim.x) {
      dst[i] = src[i];
    }
  }
}

// Converting: N elements per thread (packs of N; offsets and row in packs).
template <typename S, typename D, int N>
__global__ void state_cvt_kernel(const __grid_constant__ StateParams p) {
  const int64_t rows = p.n_taps * p.n_layers;
  for (int64_t rr = blockIdx.y; rr < rows; rr += gridDim.y) {
    const int l = (int)(rr / p.n_taps);
    const int64_t t = rr - (int64_t)l * p.n_taps;
    const Pack<S, N>* src = reinterpret_cast<const Pack<S, N>*>(p.src[l]) + p.taps[2 * t];
    Pack<D, N>* dst = reinterpret_cast<Pack<D, N>*>(p.dst[l]) + p.taps[2 * t + 1];
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < p.row;
         i += (int64_t)gridDim.x * blockDim.x) {
      const Pack<S, N> a = src[i];
      Pack<D, N> b;
#pragma unroll
      for (int j = 0; j < N; ++j) b.v[j] = Conv<D>::from_f(Conv<S>::to_f(a.v[j]));
      dst[i] = b;
    }
  }
}

template <typename K>
static void launch_grid(const StateParams& p, int max_ctas, cudaStream_t s, K kernel) {
  const int threads = 256;
  const int gx = grid_x_for(p.row, threads, 64);
  const dim3 grid(gx, grid_y_for(p.n_taps * p.n_layers, gx, max_ctas));
  kernel<<<grid, threads, 0, s>>>(p);
}

template <typename S, typename D>
static void launch_state_cvt(const StateParams& p, bool vec, int max_ctas, cudaStream_t s) {
  constexpr int big = sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D);
  constexpr int N = 16 / big;
  if (vec) {
    launch_grid(p, max_ctas, s, state_cvt_kernel<S, D, N>);
  } else {
    launch_grid(p, max_ctas, s, state_cvt_kernel<S, D, 1>);
  }
}

template <typename S>
static int dispatch_dst(int dst_dtype, const StateParams& p, bool vec, int mc, cudaStream_t s) {
  switch (dst_dtype) {
    case F32: launch_state_cvt<S, float>(p, vec, mc, s); return 0;
    case F16: launch_state_cvt<S, __half>(p, vec, mc, s); return 0;
    case BF16: launch_state_cvt<S, __nv_bfloat16>(p, vec, mc, s); return 0;
  }
  return -1;
}

// -------------------------------------------------------------------------- conv taps
struct ConvParams {
  int64_t x[MAX_LAYERS];    // per layer: pre-convolution inputs [T, D]
  int64_t inc[MAX_LAYERS];  // per layer: incoming conv states [n, D, W] (0: none)
  int64_t dst[MAX_LAYERS];  // per layer: the pool's layer [slots, D, W]
  int n_layers;
  int64_t n_taps;
  const int64_t* taps;  // [n_taps, 4]: pos, first x row (start+pos-W), incoming off, dst off
  int64_t dim, width;   // D, W
  int64_t x_t, x_c;     // element strides of x
  int64_t in_c, in_j;   // element strides of incoming (row offset is per tap)
  int64_t d_c, d_j;     // element strides of the destination (slot offset is per tap)
  int x_dtype, in_dtype, dst_dtype;
};

__device__ __forceinline__ float load_f(const void* base, int64_t i, int dt) {
  switch (dt) {
    case F16: return __half2float(reinterpret_cast<const __half*>(base)[i]);
    case BF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
    default: return reinterpret_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void move(const void* src, int64_t si, int sdt, void* dst, int64_t di,
                                     int ddt) {
  if (sdt == ddt) {  // raw bits
    if (sdt == F32) {
      reinterpret_cast<uint32_t*>(dst)[di] = reinterpret_cast<const uint32_t*>(src)[si];
    } else {
      reinterpret_cast<uint16_t*>(dst)[di] = reinterpret_cast<const uint16_t*>(src)[si];
    }
    return;
  }
  const float f = load_f(src, si, sdt);
  switch (ddt) {
    case F16: reinterpret_cast<__half*>(dst)[di] = __float2half(f); break;
    case BF16: reinterpret_cast<__nv_bfloat16*>(dst)[di] = __float2bfloat16(f); break;
    default: reinterpret_cast<float*>(dst)[di] = f;
  }
}

__global__ void conv_tap_kernel(const __grid_constant__ ConvParams p) {
  const int64_t rows = p.n_taps * p.n_layers;
  const int64_t n = p.dim * p.width;
  for (int64_t rr = blockIdx.y; rr < rows; rr += gridDim.y) {
    const int l = (int)(rr / p.n_taps);
    const int64_t t = rr - (int64_t)l * p.n_taps;
    const int64_t pos = p.taps[4 * t];
    const int64_t x_row0 = p.taps[4 * t + 1];
    const int64_t in_off = p.taps[4 * t + 2];
    const int64_t d_off = p.taps[4 * t + 3];
    const int64_t from_in = p.width - pos;  // columns j < from_in come from the incoming state
    const void* x = reinterpret_cast<const void*>(p.x[l]);
    const void* inc = reinterpret_cast<const void*>(p.inc[l]);
    void* dst = reinterpret_cast<void*>(p.dst[l]);
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n;
         e += (int64_t)gridDim.x * blockDim.x) {
      const int64_t c = e / p.width;
      const int64_t j = e - c * p.width;
      const int64_t di = d_off + c * p.d_c + j * p.d_j;
      if (j < from_in) {
        move(inc, in_off + c * p.in_c + (pos + j) * p.in_j, p.in_dtype, dst, di, p.dst_dtype);
      } else {
        move(x, (x_row0 + j) * p.x_t + c * p.x_c, p.x_dtype, dst, di, p.dst_dtype);
      }
    }
  }
}

// ------------------------------------------------------------------------------ C ABI
extern "C" {

int sgl_kext_abi_version() { return SGL_KEXT_ABI_VERSION; }
int sgl_kext_max_layers() { return MAX_LAYERS; }
int sgl_kext_max_buffers() { return MAX_BUFFERS; }
const char* sgl_kext_error_string(int code) {
  return code < 0 ? "invalid argument" : cudaGetErrorString((cudaError_t)code);
}

// Returns 0, a CUDA error code (> 0), or -1 for an argument the wrapper should have refused.
int sgl_kext_kv_copy(int to_staging, int n_buf, const int64_t* buf_ptr, const int64_t* row_stride,
                     const int64_t* row_bytes, const int64_t* plane_off, const int64_t* slots,
                     int64_t n_blocks, int rows, int64_t staging, int64_t pitch, int vec_bytes,
                     int max_ctas, void* stream) {
  if (n_buf < 1 || n_buf > MAX_BUFFERS || rows < 1 || n_blocks < 0) return -1;
  if (n_blocks == 0) return 0;
  KvParams p;
  for (int k = 0; k < n_buf; ++k) {
    p.buf_ptr[k] = buf_ptr[k];
    p.row_stride[k] = row_stride[k];
    p.row_bytes[k] = row_bytes[k];
    p.plane_off[k] = plane_off[k];
  }
  p.n_buf = n_buf;
  p.rows = rows;
  p.n_blocks = n_blocks;
  p.slots = slots;
  p.staging = staging;
  p.pitch = pitch;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool ts = to_staging != 0;
  switch (vec_bytes) {
    case 16: launch_kv<uint4>(p, ts, max_ctas, s); break;
    case 8: launch_kv<uint2>(p, ts, max_ctas, s); break;
    case 4: launch_kv<uint32_t>(p, ts, max_ctas, s); break;
    case 2: launch_kv<uint16_t>(p, ts, max_ctas, s); break;
    case 1: launch_kv<uint8_t>(p, ts, max_ctas, s); break;
    default: return -1;
  }
  return (int)cudaGetLastError();
}

// taps: [n_taps, 2] element offsets (source in h, destination in the pool layer), on the device.
// vec: 1 when the wrapper found every address, offset and the row aligned to a 16-byte pack.
int sgl_kext_state_taps(int n_layers, const int64_t* src, const int64_t* dst, int src_dtype,
                        int dst_dtype, const int64_t* taps, int64_t n_taps, int64_t row_elems,
                        int vec, int max_ctas, void* stream) {
  if (n_layers < 1 || n_layers > MAX_LAYERS || n_taps < 0 || row_elems < 1) return -1;
  if (n_taps == 0) return 0;
  StateParams p;
  for (int l = 0; l < n_layers; ++l) {
    p.src[l] = src[l];
    p.dst[l] = dst[l];
  }
  p.n_layers = n_layers;
  p.n_taps = n_taps;
  p.taps = taps;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (src_dtype == dst_dtype) {
    // Raw copy: the wrapper scaled offsets to `vec` units (16 bytes) when vec, else elements.
    const int es = src_dtype == F32 ? 4 : 2;
    if (vec) {
      p.row = row_elems * es / 16;
      launch_grid(p, max_ctas, s, state_raw_kernel<uint4>);
    } else {
      p.row = row_elems;
      if (es == 4) {
        launch_grid(p, max_ctas, s, state_raw_kernel<uint32_t>);
      } else {
        launch_grid(p, max_ctas, s, state_raw_kernel<uint16_t>);
      }
    }
    return (int)cudaGetLastError();
  }
  const int ss = src_dtype == F32 ? 4 : 2;
  const int ds = dst_dtype == F32 ? 4 : 2;
  const int pack = 16 / (ss > ds ? ss : ds);
  p.row = vec ? row_elems / pack : row_elems;
  int rc = -1;
  switch (src_dtype) {
    case F32: rc = dispatch_dst<float>(dst_dtype, p, vec != 0, max_ctas, s); break;
    case F16: rc = dispatch_dst<__half>(dst_dtype, p, vec != 0, max_ctas, s); break;
    case BF16: rc = dispatch_dst<__nv_bfloat16>(dst_dtype, p, vec != 0, max_ctas, s); break;
  }
  if (rc != 0) return rc;
  return (int)cudaGetLastError();
}

int sgl_kext_conv_taps(int n_layers, const int64_t* x, const int64_t* inc, const int64_t* dst,
                       const int64_t* taps, int64_t n_taps, int64_t dim, int64_t width,
                       const int64_t* strides /* x_t, x_c, in_c, in_j, d_c, d_j */, int x_dtype,
                       int in_dtype, int dst_dtype, int max_ctas, void* stream) {
  if (n_layers < 1 || n_layers > MAX_LAYERS || n_taps < 0 || dim < 1 || width < 1) return -1;
  if (n_taps == 0) return 0;
  ConvParams p;
  for (int l = 0; l < n_layers; ++l) {
    p.x[l] = x[l];
    p.inc[l] = inc[l];
    p.dst[l] = dst[l];
  }
  p.n_layers = n_layers;
  p.n_taps = n_taps;
  p.taps = taps;
  p.dim = dim;
  p.width = width;
  p.x_t = strides[0];
  p.x_c = strides[1];
  p.in_c = strides[2];
  p.in_j = strides[3];
  p.d_c = strides[4];
  p.d_j = strides[5];
  p.x_dtype = x_dtype;
  p.in_dtype = in_dtype;
  p.dst_dtype = dst_dtype;
  const int threads = 256;
  const int gx = grid_x_for(dim * width, threads, 64);
  const dim3 grid(gx, grid_y_for(n_taps * n_layers, gx, max_ctas));
  conv_tap_kernel<<<grid, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  return (int)cudaGetLastError();
}

}  // extern "C"
