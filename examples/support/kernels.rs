//! CUDA C kernels compiled with nvrtc at run time, and the CPU twins that check them (and stand in
//! for them on the host backend). Shared by the examples and the GPU tests.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each example or test uses a different part"
)]

use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use std::sync::Arc;

use gpu_pool::interop::cudarc::driver::{
    CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use gpu_pool::interop::cudarc::nvrtc::compile_ptx;
use gpu_pool::{
    Device, PoolError, interop::PITCHED_H, interop::Pitched, interop::PitchedMut, interop::grid_2d,
};

/// The kernels, in CUDA C++ after `gpu_pool::interop::PITCHED_H`: a 2D buffer is one `Pitched<T>`
/// parameter (`Pitched<const T>` for an input), and the shape a kernel covers is its output's.
pub const SOURCE: &str = r#"
// The byte-image kernels are bandwidth-bound: each thread moves 16 pixels of a row with 16-byte
// loads and stores where the row allows (pool buffers start 64-aligned, 2D ones 512-aligned, with
// pitches of a multiple of 64), and falls back to bytes at a ragged right edge. Launch them with
// `grid_16px`.
#define ROW16(ptr) (((size_t)(ptr) & 15) == 0)
extern "C" __global__ void fill_pattern(Pitched<unsigned char> dst, int seed) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 16, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!dst.contains(y, x0)) return;
    int cols = (int)dst.cols;
    unsigned char* d = dst.row(y) + x0;
    unsigned base = x0 * 7 + y * 13 + seed;
    if (x0 + 16 <= cols && ROW16(d)) {
        union { uint4 v; unsigned char b[16]; } out;
        #pragma unroll
        for (int i = 0; i < 16; ++i) out.b[i] = (unsigned char)(base + 7 * i);
        *(uint4*)d = out.v;
    } else {
        for (int i = 0; i < 16 && x0 + i < cols; ++i) d[i] = (unsigned char)(base + 7 * i);
    }
}
extern "C" __global__ void invert(Pitched<const unsigned char> src, Pitched<unsigned char> dst) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 16, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!dst.contains(y, x0)) return;
    int cols = (int)dst.cols;
    const unsigned char* s = src.row(y) + x0;
    unsigned char* d = dst.row(y) + x0;
    if (x0 + 16 <= cols && ROW16(s) && ROW16(d)) {
        uint4 v = *(const uint4*)s;
        v.x = ~v.x; v.y = ~v.y; v.z = ~v.z; v.w = ~v.w; // 255 - b, four bytes at a time
        *(uint4*)d = v;
    } else {
        for (int i = 0; i < 16 && x0 + i < cols; ++i) d[i] = 255 - s[i];
    }
}
__device__ __forceinline__ unsigned char luma(unsigned b, unsigned g, unsigned r) {
    return (unsigned char)((b * 1868u + g * 9617u + r * 4899u + (1u << 13)) >> 14);
}
extern "C" __global__ void bgr_to_gray(Pitched<const uchar3> src, Pitched<unsigned char> dst) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 16, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!dst.contains(y, x0)) return;
    int cols = (int)dst.cols;
    const unsigned char* s = (const unsigned char*)(src.row(y) + x0);
    unsigned char* d = dst.row(y) + x0;
    if (x0 + 16 <= cols && ROW16(s) && ROW16(d)) {
        union { uint4 v[3]; unsigned char b[48]; } in;
        union { uint4 v; unsigned char b[16]; } out;
        const uint4* s4 = (const uint4*)s;
        in.v[0] = s4[0]; in.v[1] = s4[1]; in.v[2] = s4[2];
        #pragma unroll
        for (int i = 0; i < 16; ++i) out.b[i] = luma(in.b[3 * i], in.b[3 * i + 1], in.b[3 * i + 2]);
        *(uint4*)d = out.v;
    } else {
        for (int i = 0; i < 16 && x0 + i < cols; ++i) d[i] = luma(s[3 * i], s[3 * i + 1], s[3 * i + 2]);
    }
}
extern "C" __global__ void threshold(Pitched<const unsigned char> src, Pitched<unsigned char> dst, unsigned char t) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 16, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!dst.contains(y, x0)) return;
    int cols = (int)dst.cols;
    const unsigned char* s = src.row(y) + x0;
    unsigned char* d = dst.row(y) + x0;
    if (x0 + 16 <= cols && ROW16(s) && ROW16(d)) {
        uint4 v = *(const uint4*)s;
        unsigned t4 = t * 0x01010101u;
        // __vcmpgtu4: 0xff in each byte where the first operand's byte is greater.
        v.x = __vcmpgtu4(v.x, t4); v.y = __vcmpgtu4(v.y, t4);
        v.z = __vcmpgtu4(v.z, t4); v.w = __vcmpgtu4(v.w, t4);
        *(uint4*)d = v;
    } else {
        for (int i = 0; i < 16 && x0 + i < cols; ++i) d[i] = s[i] > t ? 255 : 0;
    }
}
// Box filter, pass 1: horizontal sums of 2r+1 pixels (edges clamped) into a float intermediate.
// Four outputs a thread, stored as one float4 where the row allows; launch with `grid_4px`. The
// sums are of integers below 2^24, so exact in any order: the CPU twin matches bit for bit.
extern "C" __global__ void box_rows(Pitched<const unsigned char> src, Pitched<float> tmp, int r) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!tmp.contains(y, x0)) return;
    int cols = (int)tmp.cols;
    const unsigned char* s = src.row(y);
    float* t = tmp.row(y);
    float out[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float acc = 0.0f;
        for (int k = -r; k <= r; ++k) acc += s[min(max(x0 + j + k, 0), cols - 1)];
        out[j] = acc;
    }
    if (x0 + 4 <= cols && ROW16(t + x0)) {
        *(float4*)(t + x0) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
        for (int j = 0; j < 4 && x0 + j < cols; ++j) t[x0 + j] = out[j];
    }
}
// Pass 2: vertical sums of the intermediate; mode 0 writes the rounded mean (box filter), mode 1
// writes src > mean - c ? 255 : 0 (adaptive threshold). Four columns a thread, read as float4s.
extern "C" __global__ void box_cols(Pitched<const float> tmp, Pitched<const unsigned char> src, Pitched<unsigned char> dst, int r, int c, int mode) {
    int x0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4, y = blockIdx.y * blockDim.y + threadIdx.y;
    if (!dst.contains(y, x0)) return;
    int rows = (int)dst.rows, cols = (int)dst.cols;
    bool whole = x0 + 4 <= cols && ROW16(tmp.ptr) && (tmp.step & 15) == 0;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k = -r; k <= r; ++k) {
        const float* row = tmp.row(min(max(y + k, 0), rows - 1)) + x0;
        if (whole) {
            float4 v = *(const float4*)row;
            acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
        } else {
            for (int j = 0; j < 4 && x0 + j < cols; ++j) acc[j] += row[j];
        }
    }
    float area = (float)((2 * r + 1) * (2 * r + 1));
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (x0 + j >= cols) break;
        float mean = acc[j] / area;
        dst(y, x0 + j) = mode == 0 ? (unsigned char)(mean + 0.5f) : (src(y, x0 + j) > mean - (float)c ? 255 : 0);
    }
}
// y = max(a * x + b, 0) over n floats, with one rounding (fmaf) so the CPU twin's mul_add matches
// bit for bit: the "inference" stage of the MixMemory example. Four floats a thread, as a float4
// where both sides allow; launch with `line4`.
__device__ __forceinline__ float affine_relu1(float x, float a, float b) { return fmaxf(fmaf(a, x, b), 0.0f); }
extern "C" __global__ void affine_relu(const float* x, float* y, int n, float a, float b) {
    int i0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= n) return;
    if (i0 + 4 <= n && ROW16(x + i0) && ROW16(y + i0)) {
        float4 v = *(const float4*)(x + i0);
        v.x = affine_relu1(v.x, a, b); v.y = affine_relu1(v.y, a, b);
        v.z = affine_relu1(v.z, a, b); v.w = affine_relu1(v.w, a, b);
        *(float4*)(y + i0) = v;
    } else {
        for (int i = i0; i < i0 + 4 && i < n; ++i) y[i] = affine_relu1(x[i], a, b);
    }
}
// y[r][c] = max(h[r][c] + bias[c], 0): a dense layer's bias and ReLU after its GEMM. One thread an
// element: launch with `grid_2d`.
extern "C" __global__ void bias_relu(Pitched<const float> h, const float* bias, Pitched<float> y) {
    unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
    if (y.contains(r, c)) y(r, c) = fmaxf(h(r, c) + bias[c], 0.0f);
}
// Waits about `spin` clock cycles, then copies: a reader that is still running when the owner
// stream moves on.
extern "C" __global__ void slow_copy(const unsigned char* src, unsigned char* dst, int n, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
"#;

#[derive(gpu_pool::GraphKey)]
pub struct Kernels {
    pub fill_pattern: CudaFunction,
    pub invert: CudaFunction,
    pub bgr_to_gray: CudaFunction,
    pub threshold: CudaFunction,
    pub slow_copy: CudaFunction,
    pub box_rows: CudaFunction,
    pub box_cols: CudaFunction,
    pub affine_relu: CudaFunction,
    pub bias_relu: CudaFunction,
}

impl Kernels {
    pub fn load(device: &Device) -> Kernels {
        let ctx: &Arc<_> = device.cudarc().expect("a CUDA device");
        let ptx =
            compile_ptx(format!("{PITCHED_H}{SOURCE}")).expect("nvrtc compiles the test kernels");
        let module = ctx.load_module(ptx).expect("the module loads");
        let f = |name: &str| module.load_function(name).expect("kernel present");
        Kernels {
            fill_pattern: f("fill_pattern"),
            invert: f("invert"),
            bgr_to_gray: f("bgr_to_gray"),
            threshold: f("threshold"),
            slow_copy: f("slow_copy"),
            box_rows: f("box_rows"),
            box_cols: f("box_cols"),
            affine_relu: f("affine_relu"),
            bias_relu: f("bias_relu"),
        }
    }
}

// One typed launcher per kernel, shared by the examples, the GPU tests and the benches: each takes
// the kernel's own parameters as Rust types, and its launch configuration is chosen here. A 2D
// kernel covers its output's shape; an input of another shape is `PoolError::DimensionMismatch`.
//
// # Safety (every launcher)
// Each argument's memory is on `stream`'s device and stays allocated until the stream has run the
// kernel (a `Pitched` made from a pool buffer borrows it only for the call). The parameters
// passed match the kernel's signature in `SOURCE`.

/// `Ok` if `src` has `dst`'s shape.
fn same_shape<S, D>(src: &Pitched<'_, S>, dst: &PitchedMut<'_, D>) -> Result<(), PoolError> {
    if (src.rows(), src.cols()) == (dst.rows(), dst.cols()) {
        Ok(())
    } else {
        Err(PoolError::DimensionMismatch {
            dst: (dst.rows(), dst.cols()),
            src: (src.rows(), src.cols()),
        })
    }
}

/// `dst[y][x] = pattern(x, y, seed)`.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn fill_pattern(
    k: &Kernels,
    stream: &CudaStream,
    dst: PitchedMut<'_, u8>,
    seed: i32,
) -> Result<(), PoolError> {
    let grid = grid_16px(dst.rows(), dst.cols())?;
    // SAFETY: the caller's contract.
    unsafe {
        stream
            .launch_builder(&k.fill_pattern)
            .arg(&dst)
            .arg(&seed)
            .launch(grid)
    }?;
    Ok(())
}

/// Launches `f(src, dst)`, a kernel of one input and one output of the same shape, over `dst`.
///
/// # Safety
/// See the note above the launchers; `f` takes `(Pitched<const S>, Pitched<D>)`.
unsafe fn one_in_one_out<S, D>(
    stream: &CudaStream,
    f: &CudaFunction,
    src: Pitched<'_, S>,
    dst: PitchedMut<'_, D>,
) -> Result<(), PoolError> {
    same_shape(&src, &dst)?;
    let grid = grid_16px(dst.rows(), dst.cols())?;
    // SAFETY: the caller's contract.
    unsafe { stream.launch_builder(f).arg(&src).arg(&dst).launch(grid) }?;
    Ok(())
}

/// `dst = 255 - src`.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn invert(
    k: &Kernels,
    stream: &CudaStream,
    src: Pitched<'_, u8>,
    dst: PitchedMut<'_, u8>,
) -> Result<(), PoolError> {
    // SAFETY: the caller's contract; `invert` takes (Pitched<const u8>, Pitched<u8>).
    unsafe { one_in_one_out(stream, &k.invert, src, dst) }
}

/// `dst = gray(src)`: 3-byte BGR pixels in, bytes out.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn bgr_to_gray(
    k: &Kernels,
    stream: &CudaStream,
    src: Pitched<'_, [u8; 3]>,
    dst: PitchedMut<'_, u8>,
) -> Result<(), PoolError> {
    // SAFETY: the caller's contract; `bgr_to_gray` takes (Pitched<const uchar3>, Pitched<u8>).
    unsafe { one_in_one_out(stream, &k.bgr_to_gray, src, dst) }
}

/// `dst = src > t ? 255 : 0`.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn threshold(
    k: &Kernels,
    stream: &CudaStream,
    src: Pitched<'_, u8>,
    dst: PitchedMut<'_, u8>,
    t: u8,
) -> Result<(), PoolError> {
    same_shape(&src, &dst)?;
    let grid = grid_16px(dst.rows(), dst.cols())?;
    let mut l = stream.launch_builder(&k.threshold);
    l.arg(&src).arg(&dst).arg(&t);
    // SAFETY: the caller's contract.
    unsafe { l.launch(grid) }?;
    Ok(())
}

/// The box filter's first pass: `tmp` = sums of `2r+1` bytes of `src` along each row.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn box_rows(
    k: &Kernels,
    stream: &CudaStream,
    src: Pitched<'_, u8>,
    tmp: PitchedMut<'_, f32>,
    radius: i32,
) -> Result<(), PoolError> {
    same_shape(&src, &tmp)?;
    let grid = grid_4px(tmp.rows(), tmp.cols())?;
    let mut l = stream.launch_builder(&k.box_rows);
    l.arg(&src).arg(&tmp).arg(&radius);
    // SAFETY: the caller's contract.
    unsafe { l.launch(grid) }?;
    Ok(())
}

/// The box filter's second pass: sums of `2r+1` rows of `tmp` into `dst`, as the rounded mean
/// (`mode` 0) or `src > mean - c ? 255 : 0` (`mode` 1).
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn box_cols(
    k: &Kernels,
    stream: &CudaStream,
    (tmp, src): (Pitched<'_, f32>, Pitched<'_, u8>),
    dst: PitchedMut<'_, u8>,
    radius: i32,
    (c, mode): (i32, i32),
) -> Result<(), PoolError> {
    same_shape(&tmp, &dst)?;
    same_shape(&src, &dst)?;
    let grid = grid_4px(dst.rows(), dst.cols())?;
    let mut l = stream.launch_builder(&k.box_cols);
    l.arg(&tmp).arg(&src).arg(&dst);
    l.arg(&radius).arg(&c).arg(&mode);
    // SAFETY: the caller's contract.
    unsafe { l.launch(grid) }?;
    Ok(())
}

/// Both box filter passes: `src` (u8) through `tmp` (f32) into `dst` (u8).
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn box_passes(
    k: &Kernels,
    stream: &CudaStream,
    (src, mut tmp): (Pitched<'_, u8>, PitchedMut<'_, f32>),
    dst: PitchedMut<'_, u8>,
    radius: i32,
    c_mode: (i32, i32),
) -> Result<(), PoolError> {
    // SAFETY: the caller's contract covers both passes.
    unsafe {
        box_rows(k, stream, src, tmp.reborrow(), radius)?;
        box_cols(k, stream, (tmp.as_const(), src), dst, radius, c_mode)
    }
}

/// `y = max(a * x + b, 0)` over `n` floats.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn affine_relu(
    k: &Kernels,
    stream: &CudaStream,
    (x, y): (u64, u64),
    n: usize,
    (a, b): (f32, f32),
) -> Result<(), DriverError> {
    let ni = n as i32;
    let mut l = stream.launch_builder(&k.affine_relu);
    l.arg(&x).arg(&y).arg(&ni).arg(&a).arg(&b);
    // SAFETY: the caller's contract.
    unsafe { l.launch(line4(n)) }.map(drop)
}

/// `y[r][c] = max(h[r][c] + bias[c], 0)`; `bias` holds `y.cols()` floats.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn bias_relu(
    k: &Kernels,
    stream: &CudaStream,
    h: Pitched<'_, f32>,
    bias: u64,
    y: PitchedMut<'_, f32>,
) -> Result<(), PoolError> {
    same_shape(&h, &y)?;
    let grid = grid_2d(y.rows(), y.cols())?;
    let mut l = stream.launch_builder(&k.bias_relu);
    l.arg(&h).arg(&bias).arg(&y);
    // SAFETY: the caller's contract.
    unsafe { l.launch(grid) }?;
    Ok(())
}

/// Waits about `spin` clock cycles on the GPU, then copies `n` bytes: one block of 256 threads.
/// Work queued after it on `stream` is still pending when the host goes on.
///
/// # Safety
/// See the note above the launchers.
pub unsafe fn slow_copy(
    k: &Kernels,
    stream: &CudaStream,
    (src, dst): (u64, u64),
    n: usize,
    spin: i64,
) -> Result<(), DriverError> {
    let ni = n as i32;
    let mut l = stream.launch_builder(&k.slow_copy);
    l.arg(&src).arg(&dst).arg(&ni).arg(&spin);
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's contract.
    unsafe { l.launch(one_block) }.map(drop)
}

/// The launch of the byte-image kernels (`fill_pattern`, `invert`, `bgr_to_gray`, `threshold`):
/// one thread per 16 pixels of a row.
pub fn grid_16px(rows: usize, cols: usize) -> Result<LaunchConfig, PoolError> {
    grid_2d(rows, cols.div_ceil(16))
}

/// The launch of the box filter's passes: one thread per 4 pixels of a row.
pub fn grid_4px(rows: usize, cols: usize) -> Result<LaunchConfig, PoolError> {
    grid_2d(rows, cols.div_ceil(4))
}

/// The launch of `affine_relu`: one thread per 4 elements, 256 a block.
pub fn line4(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n.div_ceil(4) as u32)
}

/// CPU twin of `affine_relu`.
pub fn affine_relu_of(x: f32, a: f32, b: f32) -> f32 {
    a.mul_add(x, b).max(0.0)
}

/// CPU twin of `fill_pattern`.
pub fn pattern(x: usize, y: usize, seed: i32) -> u8 {
    (x as i32 * 7 + y as i32 * 13 + seed) as u8
}

/// CPU twin of `threshold`.
pub fn threshold_of(v: u8, t: u8) -> u8 {
    if v > t { 255 } else { 0 }
}

/// CPU twin of `bgr_to_gray`: BT.601 luma in fixed point, as OpenCV's `cvtColor(BGR2GRAY)`.
pub fn gray_of([b, g, r]: [u8; 3]) -> u8 {
    ((u32::from(b) * 1868 + u32::from(g) * 9617 + u32::from(r) * 4899 + (1 << 13)) >> 14) as u8
}

/// A launch-bound pipeline of six kernels over three stack temporaries, what a CUDA graph saves
/// most on: gray = luma(src); inv = 255 - gray; gray = box mean of inv (two passes through an f32
/// intermediate); inv = threshold(gray); out = 255 - inv.
///
/// `out` is taken by shared reference, as graph capture needs (see `Stream::capture`): the kernels
/// write it through its address.
#[gpu_pool::pooled(stream)]
pub fn six_kernels(
    stream: &gpu_pool::Stream,
    k: &Kernels,
    src: &gpu_pool::compat::opencv::GpuMat<'_, [u8; 3]>,
    out: &gpu_pool::compat::opencv::GpuMat<'_, u8>,
) -> Result<(), gpu_pool::PoolError> {
    let shape = (src.rows(), src.cols());
    if (out.rows(), out.cols()) != shape {
        return Err(gpu_pool::PoolError::DimensionMismatch {
            dst: (out.rows(), out.cols()),
            src: shape,
        });
    }
    let mut gray = gpu_pool::buffer!(shape.0, shape.1; u8)?;
    let mut inv = gpu_pool::buffer!(shape.0, shape.1; u8)?;
    let mut sums = gpu_pool::buffer!(shape.0, shape.1; f32)?;
    let cuda = stream.cudarc()?;
    // SAFETY: `out` is written through its address, as capture needs (see above): it is
    // `shape` bytes (checked above), and nothing else uses it while the kernels run.
    let mut out =
        unsafe { PitchedMut::<u8>::from_raw_parts(out.device_ptr(), out.step(), shape.0, shape.1) };
    // SAFETY: every buffer is `shape` of its type (checked above, or taken so), lives on
    // `stream`'s device and outlives the queued kernels: the temporaries are released to this
    // stream's stack, so later work of this stream alone can reuse them, after these kernels.
    unsafe {
        bgr_to_gray(k, cuda, src.pitched(), gray.pitched_mut())?;
        invert(k, cuda, gray.pitched(), inv.pitched_mut())?;
        let sums = sums.pitched_mut();
        box_passes(
            k,
            cuda,
            (inv.pitched(), sums),
            gray.pitched_mut(),
            2,
            (0, 0),
        )?;
        threshold(k, cuda, gray.pitched(), inv.pitched_mut(), 100)?;
        invert(k, cuda, inv.pitched(), out.reborrow())?;
    }
    Ok(())
}
