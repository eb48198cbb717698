//! CUDA graph replay of one 2-layer MLP forward pass, captured three ways, side by side in one run.
//!
//! The pass: `x` (32x784 f32) -> `h = relu(x W1 + b1)` (32x256) -> `logits = h W2 + b2` (32x10)
//! -> `probs = softmax(logits)` row by row; the GEMMs in cuBLAS (SGEMM), the bias/ReLU, bias and
//! softmax in three small nvrtc kernels. `h` and `logits` are temporaries; the inputs, weights and
//! `probs` are allocated once, packed (leading dimension = columns), before the captures. Every
//! variant queues the same cuBLAS calls and the same kernels; what differs is where the temporaries
//! (and cuBLAS's workspace) live and how the graph is made:
//!
//! - `gpu-pool padded`: a `#[pooled(stream)]` function whose temporaries are
//!   `buffer!(rows, cols; f32)` (rows padded to 512 bytes), captured with `Stream::capture`;
//!   cuBLAS works in a `buffer!(BLAS_WORKSPACE_BYTES; u8)` lent with `with_blas_workspace`;
//! - `gpu-pool packed`: the same with `buffer!(rows, cols; f32, packed)` temporaries;
//! - `packed, cuBLAS's workspace`: packed, on a cudarc `CudaBlas::new` handle with no workspace
//!   lent (cuBLAS allocates its own inside the capture: allocation and free nodes);
//! - `guide: shared weights`: the guide's code: packed, the weights `SharedMat`s read inside the
//!   capture, the handle from `Stream::cublas` (a workspace of its own), nothing lent;
//! - `cudarc`: plain cudarc on a stream of its own: `alloc_zeros` temporaries made inside the
//!   capture (graph allocation, memset and free nodes), cuBLAS with its default workspace,
//!   captured with `begin_capture` / `end_capture` and replayed with `CudaGraph::launch`.
//!
//! cudarc's event tracking is turned off before any cudarc slice exists (one stream does all of
//! cudarc's work, and a capture may not wait on events recorded outside it); gpu-pool's buffers
//! never use it. All three outputs are checked against each other, against an f64 CPU reference,
//! and for rows that sum to 1. Then each round, each variant (the first one rotating) queues
//! `REPLAYS` replays and waits for its stream; wall time / `REPLAYS` is one sample. The median,
//! min and max per replay, the host's time to queue one, and the ratios to `cudarc` are printed as
//! a markdown table, with each graph's nodes and the stack bytes the gpu-pool graphs hold.
//!
//! `cargo bench -p gpu-pool-benches --bench mlp_graph [-- ROUNDS [REPLAYS]]` (or `MLP_ROUNDS` /
//! `MLP_REPLAYS`; 15 rounds of 1000 replays by default). Without a CUDA device (or cuBLAS) it says
//! so and measures nothing.

#[path = "../support/run.rs"]
mod run;

use std::sync::Arc;
use std::time::Instant;

use gpu_pool::compat::opencv::GpuMat;
use gpu_pool::interop::cudarc::cublas::{
    CudaBlas, Gemm, GemmConfig, result::CublasError, sys as blas_sys,
};
use gpu_pool::interop::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError, LaunchConfig,
    PushKernelArg, sys,
};
use gpu_pool::interop::cudarc::nvrtc::compile_ptx;
use gpu_pool::prelude::*;
use gpu_pool::{
    compat::opencv::set_buffer_pool_config, config::Fallback, interop::BLAS_WORKSPACE_BYTES,
    interop::with_blas_workspace,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const BATCH: usize = 32;
const IN: usize = 784;
const HIDDEN: usize = 256;
const CLASSES: usize = 10;
/// x, W1, b1, W2, b2: rows and columns.
const SHAPES: [(usize, usize); 5] = [
    (BATCH, IN),
    (IN, HIDDEN),
    (1, HIDDEN),
    (HIDDEN, CLASSES),
    (1, CLASSES),
];
/// The kernels of `SOURCE`, in `Kernels`' order.
const BIAS_RELU: usize = 0;
const BIAS: usize = 1;
const SOFTMAX: usize = 2;
const NAMES: [&str; 5] = [
    "gpu-pool padded",
    "gpu-pool packed",
    "packed, cuBLAS's workspace",
    "guide: shared weights",
    "cudarc",
];
const CUDARC: usize = NAMES.len() - 1;

/// Every parameter is 64-bit (an address, or a leading dimension or size in elements), so every
/// variant launches the same kernels with the same `u64` arguments.
const SOURCE: &str = r#"
typedef unsigned long long u64;
extern "C" __global__ void bias_relu(float* m, u64 ld, const float* b, u64 rows, u64 cols) {
    u64 i = blockIdx.x * blockDim.x + threadIdx.x, r = i / cols, c = i % cols;
    if (r < rows) m[r * ld + c] = fmaxf(m[r * ld + c] + b[c], 0.0f);
}
extern "C" __global__ void bias(float* m, u64 ld, const float* b, u64 rows, u64 cols) {
    u64 i = blockIdx.x * blockDim.x + threadIdx.x, r = i / cols, c = i % cols;
    if (r < rows) m[r * ld + c] += b[c];
}
extern "C" __global__ void softmax(const float* z, u64 ldz, float* p, u64 ldp, u64 rows, u64 cols) {
    u64 r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* zr = z + r * ldz;
    float* pr = p + r * ldp;
    float m = zr[0], s = 0.0f;
    for (u64 c = 1; c < cols; ++c) m = fmaxf(m, zr[c]);
    for (u64 c = 0; c < cols; ++c) { pr[c] = expf(zr[c] - m); s += pr[c]; }
    for (u64 c = 0; c < cols; ++c) pr[c] /= s;
}
"#;

/// `bias_relu`, `bias`, `softmax`.
struct Kernels([CudaFunction; 3]);

impl Kernels {
    /// `m = relu(m + b)` (`BIAS_RELU`) or `m += b` (`BIAS`) over `rows x cols` at leading dimension
    /// `ld`, `b` broadcast over the rows: `args` = `[m, ld, b, rows, cols]`. `p = softmax(z)` row
    /// by row (`SOFTMAX`): `[z, ldz, p, ldp, rows, cols]`. One thread an element (a row for `SOFTMAX`).
    ///
    /// # Safety
    /// Each address holds its matrix at its leading dimension (`b` `cols` floats), in memory of
    /// `cs`'s context that outlives the kernel (or the graph it is captured into).
    unsafe fn launch(
        &self,
        cs: &CudaStream,
        kernel: usize,
        args: &[u64],
    ) -> Result<(), DriverError> {
        let (rows, cols) = (args[args.len() - 2], args[args.len() - 1]);
        let threads = if kernel == SOFTMAX { rows } else { rows * cols };
        let mut l = cs.launch_builder(&self.0[kernel]);
        for arg in args {
            l.arg(arg);
        }
        // SAFETY: the caller's contract; the parameters are as in `SOURCE`.
        unsafe { l.launch(LaunchConfig::for_num_elems(threads as u32)) }?;
        Ok(())
    }
}

/// `c = a b` for row-major `a` (rows x inner), `b` (inner x cols) and `c` (rows x cols), at the
/// leading dimensions `lds` (a's, b's, c's). cuBLAS is column-major, so it computes
/// `c^T = b^T a^T`, as `examples/support/dense.rs` does.
///
/// # Safety
/// Each operand holds its matrix at its leading dimension, on the handle's device.
unsafe fn gemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    blas: &CudaBlas,
    a: &A,
    b: &B,
    c: &mut C,
    [lds, (rows, inner, cols)]: [(usize, usize, usize); 2],
) -> Result<(), CublasError> {
    let cfg = GemmConfig {
        transa: blas_sys::cublasOperation_t::CUBLAS_OP_N,
        transb: blas_sys::cublasOperation_t::CUBLAS_OP_N,
        m: cols as i32,
        n: rows as i32,
        k: inner as i32,
        alpha: 1.0f32,
        lda: lds.1 as i32,
        ldb: lds.0 as i32,
        beta: 0.0f32,
        ldc: lds.2 as i32,
    };
    // SAFETY: the caller's contract: every access stays inside the operands.
    unsafe { blas.gemm(cfg, b, a, c) }
}

/// The pass on pool memory, into the temporaries `h` and `logits`; `probs` is written through its
/// address (an output captured by shared reference, read between replays).
fn layers<W: GpuRead<f32>>(
    cs: &CudaStream,
    (blas, k): (&CudaBlas, &Kernels),
    [x, w1, b1, w2, b2]: [&W; 5],
    h: &mut impl GpuWrite<f32>,
    logits: &mut impl GpuWrite<f32>,
    probs: &GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let ld = |step: usize| (step / size_of::<f32>()) as u64;
    let (hp, hl, zp, zl) = (
        h.device_ptr(),
        ld(h.step()),
        logits.device_ptr(),
        ld(logits.step()),
    );
    let (rows, hidden, classes) = (BATCH as u64, HIDDEN as u64, CLASSES as u64);
    // SAFETY: every matrix has its shape, at the leading dimension taken with it; all of them are
    // memory of `cs`'s stack or allocated before the capture, and outlive the graph.
    unsafe {
        let (xs, w1s, mut hs) = (x.as_cudarc()?, w1.as_cudarc()?, h.as_cudarc_mut()?);
        let l1 = [(xs.ld(), w1s.ld(), hs.ld()), (BATCH, IN, HIDDEN)];
        gemm(blas, &xs, &w1s, &mut hs, l1)?;
        k.launch(cs, BIAS_RELU, &[hp, hl, b1.device_ptr(), rows, hidden])?;
        let (hs, w2s, mut zs) = (h.as_cudarc()?, w2.as_cudarc()?, logits.as_cudarc_mut()?);
        let l2 = [(hs.ld(), w2s.ld(), zs.ld()), (BATCH, HIDDEN, CLASSES)];
        gemm(blas, &hs, &w2s, &mut zs, l2)?;
        k.launch(cs, BIAS, &[zp, zl, b2.device_ptr(), rows, classes])?;
        let p = [probs.device_ptr(), ld(probs.step())];
        k.launch(cs, SOFTMAX, &[zp, zl, p[0], p[1], rows, classes])?;
    }
    Ok(())
}

/// The pass with padded temporaries, cuBLAS working in a stack workspace.
#[pooled(stream)]
fn forward_padded(
    stream: &Stream,
    (blas, k): (&mut gpu_pool::interop::Blas, &Kernels),
    net: &[GpuMat<'_, f32>; 5],
    probs: &GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let cs = stream.cudarc().expect("a CUDA stream");
    let mut room = buffer!(BLAS_WORKSPACE_BYTES; u8)?;
    let mut h = buffer!(BATCH, HIDDEN; f32)?;
    let mut logits = buffer!(BATCH, CLASSES; f32)?;
    with_blas_workspace(blas, room.view_mut(), |blas| {
        layers(cs, (blas, k), net.each_ref(), &mut h, &mut logits, probs)
    })?
}

/// The same with packed temporaries.
#[pooled(stream)]
fn forward_packed(
    stream: &Stream,
    (blas, k): (&mut gpu_pool::interop::Blas, &Kernels),
    net: &[GpuMat<'_, f32>; 5],
    probs: &GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let cs = stream.cudarc().expect("a CUDA stream");
    let mut room = buffer!(BLAS_WORKSPACE_BYTES; u8)?;
    let mut h = buffer!(BATCH, HIDDEN; f32, packed)?;
    let mut logits = buffer!(BATCH, CLASSES; f32, packed)?;
    with_blas_workspace(blas, room.view_mut(), |blas| {
        layers(cs, (blas, k), net.each_ref(), &mut h, &mut logits, probs)
    })?
}

/// The same with packed temporaries, on a handle with cuBLAS's default workspace (cudarc's
/// `CudaBlas::new`).
#[pooled(stream)]
fn forward_no_workspace(
    stream: &Stream,
    (blas, k): (&CudaBlas, &Kernels),
    net: &[GpuMat<'_, f32>; 5],
    probs: &GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let cs = stream.cudarc().expect("a CUDA stream");
    let mut h = buffer!(BATCH, HIDDEN; f32, packed)?;
    let mut logits = buffer!(BATCH, CLASSES; f32, packed)?;
    layers(cs, (blas, k), net.each_ref(), &mut h, &mut logits, probs)
}

/// The guide's pass: packed, on weights shared as `SharedMat`s read inside the capture, cuBLAS in
/// the workspace `Stream::cublas` gave its handle.
#[pooled(stream)]
fn forward_shared(
    stream: &Stream,
    (blas, k): (&CudaBlas, &Kernels),
    net: &[SharedMat<f32>; 5],
    probs: &GpuMat<'_, f32>,
) -> Result<(), PoolError> {
    let cs = stream.cudarc().expect("a CUDA stream");
    let mut h = buffer!(BATCH, HIDDEN; f32, packed)?;
    let mut logits = buffer!(BATCH, CLASSES; f32, packed)?;
    let [a, b, c, d, e] = net.each_ref().map(|m| m.read(stream));
    let guards = [a?, b?, c?, d?, e?];
    layers(cs, (blas, k), guards.each_ref(), &mut h, &mut logits, probs)
}

/// The pass in plain cudarc: the temporaries are allocated (and zeroed) on `cs` and freed when
/// they drop, at the end; inside a capture, those are graph nodes.
fn forward_cudarc(
    cs: &Arc<CudaStream>,
    (blas, k): (&CudaBlas, &Kernels),
    [x, w1, b1, w2, b2]: &[CudaSlice<f32>; 5],
    probs: &mut CudaSlice<f32>,
) -> Res<()> {
    let mut h = cs.alloc_zeros::<f32>(BATCH * HIDDEN)?;
    let mut logits = cs.alloc_zeros::<f32>(BATCH * CLASSES)?;
    let (rows, hidden, classes) = (BATCH as u64, HIDDEN as u64, CLASSES as u64);
    // SAFETY: every slice holds its packed matrix (`SHAPES`, or made above), all of them on `cs`,
    // the stream cuBLAS and the kernels queue on; the inputs and `probs` outlive the graph, and
    // the temporaries are freed on `cs` after the kernels that use them.
    unsafe {
        let l1 = [(IN, HIDDEN, HIDDEN), (BATCH, IN, HIDDEN)];
        gemm(blas, x, w1, &mut h, l1)?;
        let (hp, b1p) = (h.device_ptr_mut(cs).0, b1.device_ptr(cs).0);
        k.launch(cs, BIAS_RELU, &[hp, hidden, b1p, rows, hidden])?;
        let l2 = [(HIDDEN, CLASSES, CLASSES), (BATCH, HIDDEN, CLASSES)];
        gemm(blas, &h, w2, &mut logits, l2)?;
        let (zp, b2p) = (logits.device_ptr_mut(cs).0, b2.device_ptr(cs).0);
        k.launch(cs, BIAS, &[zp, classes, b2p, rows, classes])?;
        let pp = probs.device_ptr_mut(cs).0;
        k.launch(cs, SOFTMAX, &[zp, classes, pp, classes, rows, classes])?;
    }
    Ok(())
}

/// A graph's nodes by kind, counted and printed as `Graph::nodes` does (for cudarc's graph).
fn census(graph: sys::CUgraph) -> Res<String> {
    use sys::CUgraphNodeType as Kind;
    let mut count = 0usize;
    // SAFETY: a live graph (the caller's `CudaGraph` owns it); a null array asks for the count.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) }.result()?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: as above; `nodes` has room for `count` handles.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) }.result()?;
    let [
        mut kernels,
        mut memcpys,
        mut memsets,
        mut allocs,
        mut frees,
        mut others,
    ] = [0; 6];
    for &node in &nodes[..count.min(nodes.len())] {
        let mut kind = Kind::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node of the live graph, as the driver just listed it.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result()?;
        *match kind {
            Kind::CU_GRAPH_NODE_TYPE_KERNEL => &mut kernels,
            Kind::CU_GRAPH_NODE_TYPE_MEMCPY => &mut memcpys,
            Kind::CU_GRAPH_NODE_TYPE_MEMSET => &mut memsets,
            Kind::CU_GRAPH_NODE_TYPE_MEM_ALLOC => &mut allocs,
            Kind::CU_GRAPH_NODE_TYPE_MEM_FREE => &mut frees,
            _ => &mut others,
        } += 1;
    }
    Ok(format!(
        "GraphNodes {{ kernels: {kernels}, memcpys: {memcpys}, memsets: {memsets}, allocs: \
         {allocs}, frees: {frees}, others: {others} }}"
    ))
}

fn main() -> Res<()> {
    let device = match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            println!("no CUDA device ({e}): the mlp_graph benchmark measured nothing");
            return Ok(());
        }
    };
    let (rounds, replays) = (
        run::count(0, "MLP_ROUNDS", 15),
        run::count(1, "MLP_REPLAYS", 1000),
    );
    let ctx = device.cudarc().expect("a CUDA device").clone();
    // SAFETY: before any cudarc slice exists; all of cudarc's work (slices, cuBLAS, kernels,
    // the capture) is on one stream, `cs`, so no slice is used on another stream.
    unsafe { ctx.disable_event_tracking() };
    ctx.bind_to_thread()?;
    device.set_fallback(Fallback::Error); // every gpu-pool temporary must come from the stack
    set_buffer_pool_config(&device, 128 << 20, 1)?; // two graphs, each with a 32 MiB workspace
    let stream = Stream::new(&device)?;
    let (mut blas_padded, mut blas_packed, blas_shared) =
        match (stream.cublas(), stream.cublas(), stream.cublas()) {
            (Ok(a), Ok(b), Ok(c)) => (a, b, c),
            (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => {
                println!("no cuBLAS ({e}): the mlp_graph benchmark measured nothing");
                return Ok(());
            }
        };
    // cudarc's own handle on the pool stream: cuBLAS's default workspace, which `Stream::cublas`
    // replaces with one of the handle's own.
    let blas_bare = CudaBlas::new(stream.cudarc().expect("a CUDA stream").clone())?;
    let cs = ctx.new_stream()?;
    let blas_cudarc = CudaBlas::new(cs.clone())?;
    println!(
        "device: {} ({}, driver {}); cudarc event tracking: {}",
        device.id(),
        ctx.name()?,
        run::driver_version()?,
        if ctx.is_event_tracking() { "on" } else { "off" }
    );
    let ptx = compile_ptx(SOURCE)?;
    let module = ctx.load_module(ptx)?;
    let k = Kernels(
        ["bias_relu", "bias", "softmax"]
            .map(|n| module.load_function(n).expect("every kernel is in SOURCE")),
    );

    let host = parameters();
    let net = std::array::from_fn(|i| -> Res<GpuMat<'_, f32>> {
        let mut m = GpuMat::new_packed(&stream, SHAPES[i].0, SHAPES[i].1)?;
        m.upload(&host[i])?;
        Ok(m)
    });
    let [a, b, c, d, e] = net;
    let net = &[a?, b?, c?, d?, e?];
    let [a, b, c, d, e] = host.each_ref().map(|v| cs.clone_htod(v));
    let cnet = &[a?, b?, c?, d?, e?];
    let [a, b, c, d, e] =
        std::array::from_fn(|i| SharedMat::from_host(&stream, SHAPES[i].0, SHAPES[i].1, &host[i]));
    let shared = &[a?, b?, c?, d?, e?];
    let mut probs = [
        GpuMat::<f32>::new_packed(&stream, BATCH, CLASSES)?,
        GpuMat::<f32>::new_packed(&stream, BATCH, CLASSES)?,
        GpuMat::<f32>::new_packed(&stream, BATCH, CLASSES)?,
        GpuMat::<f32>::new_packed(&stream, BATCH, CLASSES)?,
    ];
    let mut probs_cudarc = cs.alloc_zeros::<f32>(BATCH * CLASSES)?;
    // One eager pass each first (cuBLAS and the module load what they load lazily); then the
    // outputs are NaN until a replay writes them.
    forward_padded(&stream, (&mut blas_padded, &k), net, &probs[0])?;
    forward_packed(&stream, (&mut blas_packed, &k), net, &probs[1])?;
    forward_no_workspace(&stream, (&blas_bare, &k), net, &probs[2])?;
    forward_shared(&stream, (&blas_shared, &k), shared, &probs[3])?;
    forward_cudarc(&cs, (&blas_cudarc, &k), cnet, &mut probs_cudarc)?;
    for p in &mut probs {
        p.set_to(f32::NAN)?;
    }
    cs.memcpy_htod(&[f32::NAN; BATCH * CLASSES], &mut probs_cudarc)?;
    stream.synchronize()?;
    cs.synchronize()?;

    let padded = stream.capture(|s| forward_padded(s, (&mut blas_padded, &k), net, &probs[0]))?;
    let packed = stream.capture(|s| forward_packed(s, (&mut blas_packed, &k), net, &probs[1]))?;
    let bare = stream.capture(|s| forward_no_workspace(s, (&blas_bare, &k), net, &probs[2]))?;
    let with_shared =
        stream.capture(|s| forward_shared(s, (&blas_shared, &k), shared, &probs[3]))?;
    // The mode `Stream::capture` uses too.
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let worked = forward_cudarc(&cs, (&blas_cudarc, &k), cnet, &mut probs_cudarc);
    let ended = cs.end_capture(sys::CUgraphInstantiate_flags(0));
    worked?;
    let plain = ended?.ok_or("cudarc's capture made no graph")?;
    for (name, graph) in NAMES.iter().zip([&padded, &packed, &bare, &with_shared]) {
        let held = graph.stack_bytes();
        println!(
            "{name} nodes: {:?}; {held} stack bytes held",
            graph.nodes()?
        );
    }
    println!("cudarc nodes: {}", census(plain.cu_graph())?);

    let launch = |v: usize| -> Res<()> {
        match v {
            0 => padded.launch()?,
            1 => packed.launch()?,
            2 => bare.launch()?,
            3 => with_shared.launch()?,
            _ => plain.launch()?,
        }
        Ok(())
    };
    let wait = |v: usize| -> Res<()> {
        match v {
            0..CUDARC => stream.synchronize()?,
            _ => cs.synchronize()?,
        }
        Ok(())
    };
    for v in 0..NAMES.len() {
        launch(v)?;
        wait(v)?;
    }
    let outputs = [
        probs[0].to_vec()?,
        probs[1].to_vec()?,
        probs[2].to_vec()?,
        probs[3].to_vec()?,
        cs.clone_dtoh(&probs_cudarc)?,
    ];
    check(&outputs, &reference(&host))?;

    // Warm-up: one unrecorded round.
    let mut times = vec![Vec::with_capacity(rounds); NAMES.len()];
    for round in 0..=rounds {
        for i in 0..NAMES.len() {
            let v = (round + i) % NAMES.len(); // each round, another variant goes first
            let start = Instant::now();
            for _ in 0..replays {
                launch(v)?;
            }
            let queued = start.elapsed();
            wait(v)?;
            let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / replays as f64;
            if round > 0 {
                times[v].push((per(start.elapsed()), per(queued)));
            }
        }
    }
    print_table(&times, rounds, replays);
    Ok(())
}

/// x, W1, b1, W2, b2 (`SHAPES`), row-major: small values of both signs, so the ReLU has work to
/// do (about half of `h` is 0) and every row of `probs` differs (logits within about ±1.2).
fn parameters() -> [Vec<f32>; 5] {
    let fill = |n: usize, f: &dyn Fn(usize) -> f32| (0..n).map(f).collect::<Vec<f32>>();
    [
        fill(BATCH * IN, &|i| (i * 13 % 97) as f32 / 97.0 - 0.5),
        fill(IN * HIDDEN, &|i| ((i * 37 % 101) as f32 - 50.0) / 800.0),
        fill(HIDDEN, &|c| (c % 7) as f32 / 10.0 - 0.3),
        fill(HIDDEN * CLASSES, &|i| ((i * 53 % 89) as f32 - 44.0) / 60.0),
        fill(CLASSES, &|c| c as f32 / 10.0 - 0.5),
    ]
}

/// The pass on the CPU, in f64.
fn reference([x, w1, b1, w2, b2]: &[Vec<f32>; 5]) -> Vec<f32> {
    let dense = |a: &[f64], w: &[f32], b: &[f32], inner: usize, cols: usize| -> Vec<f64> {
        (0..BATCH * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                let dot: f64 = (0..inner)
                    .map(|j| a[r * inner + j] * f64::from(w[j * cols + c]))
                    .sum();
                dot + f64::from(b[c])
            })
            .collect()
    };
    let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let h: Vec<f64> = dense(&x, w1, b1, IN, HIDDEN)
        .iter()
        .map(|v| v.max(0.0))
        .collect();
    let logits = dense(&h, w2, b2, HIDDEN, CLASSES);
    let mut probs = Vec::with_capacity(BATCH * CLASSES);
    for row in logits.chunks(CLASSES) {
        let max = row.iter().copied().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|z| (z - max).exp()).sum();
        probs.extend(row.iter().map(|z| ((z - max).exp() / sum) as f32));
    }
    probs
}

/// The variants agree (1e-5 relative), match the CPU (1e-4 absolute), and each row sums to 1.
fn check(outputs: &[Vec<f32>; NAMES.len()], expected: &[f32]) -> Res<()> {
    let worst = |d: &mut dyn Iterator<Item = f32>| d.fold(0.0f32, f32::max);
    for (name, out) in NAMES.iter().zip(outputs) {
        let rel =
            |(a, b): (&f32, &f32)| (a - b).abs() / a.abs().max(b.abs()).max(f32::MIN_POSITIVE);
        let vs_cudarc = worst(&mut out.iter().zip(&outputs[CUDARC]).map(rel));
        let vs_cpu = worst(&mut out.iter().zip(expected).map(|(a, b)| (a - b).abs()));
        let sums = worst(
            &mut out
                .chunks(CLASSES)
                .map(|r| (r.iter().sum::<f32>() - 1.0).abs()),
        );
        println!(
            "{name}: largest relative difference from cudarc {vs_cudarc:.1e}, absolute from the \
             f64 CPU reference {vs_cpu:.1e}; largest |row sum - 1| {sums:.1e}"
        );
        let finite = out.iter().all(|v| v.is_finite()); // NaN until a replay writes them
        if !(finite && vs_cudarc <= 1e-5 && vs_cpu <= 1e-4 && sums <= 1e-5) {
            return Err(format!("{name} computes other probabilities").into());
        }
    }
    Ok(())
}

/// Median, min and max µs per replay, the host's median µs to queue one, and the ratios of the
/// medians to `cudarc`'s.
fn print_table(times: &[Vec<(f64, f64)>], rounds: usize, replays: usize) {
    let sorted = |t: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = t.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    println!(
        "\n### Graph replay of a 2-layer MLP forward pass: 32x784 -> 256 (ReLU) -> 10 -> softmax \
         ({rounds} rounds x {replays} replays a variant, interleaved)\n\n\
         | capture | median / replay | min | max | host queue / replay | vs `cudarc` |\n\
         |---|---:|---:|---:|---:|---:|"
    );
    let base = sorted(&times[CUDARC], |s| s.0)[times[CUDARC].len() / 2];
    for (name, t) in NAMES.iter().zip(times.iter()) {
        let (wall, host) = (sorted(t, |s| s.0), sorted(t, |s| s.1));
        let (m, lo, hi) = (wall[wall.len() / 2], wall[0], wall[wall.len() - 1]);
        println!(
            "| `{name}` | {m:.2} µs | {lo:.2} µs | {hi:.2} µs | {:.2} µs | {:.2}x |",
            host[host.len() / 2],
            m / base
        );
    }
}
