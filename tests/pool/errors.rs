//! What errors carry: the request context on every memory error of a buffer, the failed call's own
//! error as `source()`, and one message per situation.

use std::error::Error as _;
use std::sync::Arc;

use gpu_pool::GpuWrite;
use gpu_pool::pooled;
use gpu_pool::{
    Device, PoolError, Stream, alloc::AllocContext, alloc::AllocRequest, alloc::Allocation,
    alloc::GpuAllocator, compat::mix::MixMemory, compat::opencv::BufferPool,
    compat::opencv::GpuMat, compat::opencv::set_buffer_pool_config, config::Fallback,
};

const MIB: usize = 1 << 20;

/// Answers with a null address, which the stream refuses.
#[derive(Debug)]
struct Broken;

// SAFETY: returns a null allocation, which the pool must refuse before anything uses it.
unsafe impl GpuAllocator for Broken {
    fn allocate(&self, _: &AllocContext<'_>, _: &AllocRequest) -> Result<Allocation, PoolError> {
        Ok(Allocation::new(0, 0))
    }
    unsafe fn deallocate(&self, _: &AllocContext<'_>, _: Allocation) -> Result<(), PoolError> {
        Ok(())
    }
}

/// A device of 4 MiB with one 1 MiB stack, falling back to `fallback`.
fn small(fallback: Fallback) -> Result<Device, PoolError> {
    let device = Device::host_with_limit(4 * MIB);
    device.set_fallback(fallback);
    set_buffer_pool_config(&device, MIB, 1)?;
    Ok(device)
}

#[pooled(stream)]
fn two_mib(stream: &Stream) -> Result<(), PoolError> {
    let _big = buffer!(2 * MIB; u8)?;
    Ok(())
}

/// `err`'s request is `stream`'s, made at `line` of this file (named `name`), and its message
/// says so.
fn asked_at(err: &PoolError, stream: &Stream, line: u32, name: Option<&str>) -> Option<usize> {
    let context = err.context().unwrap_or_else(|| panic!("no request: {err}"));
    assert_eq!(context.stream, stream.id(), "{err}");
    assert_eq!(
        (
            context.site.file(),
            context.site.line(),
            context.site.name()
        ),
        (file!(), line, name),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains(&format!("stream {}", stream.id())), "{text}");
    assert!(text.contains(&format!("errors.rs:{line}")), "{text}");
    context.stack_needed
}

#[test]
fn every_memory_error_of_a_buffer_carries_its_request() -> Result<(), PoolError> {
    // Out of memory from the fallback: 8 MiB on a 4 MiB device, with nothing in use.
    let stream = Stream::new(&small(Fallback::Driver)?)?;
    let pool = BufferPool::new(&stream);
    let (line, err) = (line!(), pool.get_buffer_1d::<u8>(8 * MIB).unwrap_err());
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(asked_at(&err, &stream, line, None), Some(8 * MIB));

    // Out of memory from the driver, for a buffer of its own: no stack would have served it.
    let (line, err) = (line!(), GpuMat::<u8>::new(&stream, 8, MIB).unwrap_err());
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(asked_at(&err, &stream, line, None), None);

    // The stack exhausted, with no fallback: through `buffer!`, which names the buffer.
    let stream = Stream::new(&small(Fallback::Error)?)?;
    let err = two_mib(&stream).unwrap_err();
    assert!(matches!(err, PoolError::StackExhausted { .. }), "{err}");
    let line = err.context().expect("a request").site.line();
    assert_eq!(asked_at(&err, &stream, line, Some("_big")), Some(2 * MIB));

    // A custom allocator that answers against its contract.
    let stream = Stream::with_allocator(&small(Fallback::Driver)?, Arc::new(Broken))?;
    let pool = BufferPool::new(&stream);
    let (line, err) = (line!(), pool.get_buffer::<u8>(4, 4).unwrap_err());
    assert!(matches!(err, PoolError::AllocatorContract { .. }), "{err}");
    assert_eq!(
        asked_at(&err, &stream, line, None),
        None,
        "no stack is meant"
    );
    Ok(())
}

#[test]
fn memory_not_for_a_buffer_has_no_request() -> Result<(), PoolError> {
    let device = Device::host_with_limit(MIB);
    let err = MixMemory::new(&device)?.gpu::<u8>(2 * MIB).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }), "{err}");
    assert_eq!(err.context(), None);
    assert!(!err.to_string().contains("stream"), "{err}");
    Ok(())
}

#[cfg(feature = "timeline")]
#[test]
fn a_failed_write_keeps_the_io_error_as_its_source() {
    let path = std::env::temp_dir().join("gpu-pool-no-such-dir/trace.json");
    let err = gpu_pool::observe::timeline::write_chrome_trace(&path).unwrap_err();
    let PoolError::Io { source, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
    let io = err
        .source()
        .and_then(|e| e.downcast_ref::<std::io::Error>())
        .expect("the io::Error itself");
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    let text = err.to_string();
    assert!(text.contains("trace.json"), "{text}");
    assert!(text.contains("directory exists"), "{text}");
}

/// A library's error, as a CUDA library would return it.
#[derive(Debug, PartialEq)]
struct LibraryError(u32);

impl std::fmt::Display for LibraryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "library status {}", self.0)
    }
}

impl std::error::Error for LibraryError {}

#[test]
fn a_failed_cuda_call_keeps_its_error_as_its_source() {
    // Errors cross threads and panics as before their causes were kept.
    fn shareable<T: Send + Sync + std::panic::UnwindSafe + std::panic::RefUnwindSafe>() {}
    shareable::<PoolError>();

    let err = PoolError::Driver {
        call: "cublasSgemm",
        source: LibraryError(13).into(),
    };
    assert_eq!(
        err.source().and_then(|e| e.downcast_ref::<LibraryError>()),
        Some(&LibraryError(13))
    );
    let text = err.to_string();
    assert!(
        text.contains("cublasSgemm failed: library status 13"),
        "{text}"
    );
    // A clone shares the error, and equals the original.
    let clone = err.clone();
    assert_eq!(clone, err);
    assert!(std::ptr::eq(
        clone.source().expect("a source"),
        err.source().expect("a source")
    ));
    assert_ne!(
        err,
        PoolError::Driver {
            call: "cublasSgemm",
            source: LibraryError(14).into(),
        }
    );

    // cudarc's driver error, as the CUDA backend keeps it (not printed: printing asks the driver).
    #[cfg(feature = "cuda")]
    {
        use gpu_pool::interop::cudarc::driver::{DriverError, sys::CUresult};
        let invalid = DriverError(CUresult::CUDA_ERROR_INVALID_VALUE);
        let err = PoolError::Driver {
            call: "cuMemAlloc",
            source: invalid.into(),
        };
        assert_eq!(
            err.source().and_then(|e| e.downcast_ref::<DriverError>()),
            Some(&invalid)
        );
    }
}

#[test]
fn a_wrong_host_slice_and_a_copy_between_shapes_say_different_things() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let pool = BufferPool::new(&stream);
    let mut a = pool.get_buffer::<f32>(2, 3)?;
    let slice = a.upload(&[0.0; 5]).unwrap_err();
    assert!(
        matches!(
            slice,
            PoolError::ShapeMismatch {
                expected: 6,
                actual: 5
            }
        ),
        "{slice}"
    );
    let b = pool.get_buffer::<f32>(3, 2)?;
    let shapes = a.copy_from(&b).unwrap_err();
    assert!(
        matches!(shapes, PoolError::DimensionMismatch { .. }),
        "{shapes}"
    );
    let (slice, shapes) = (slice.to_string(), shapes.to_string());
    assert!(
        slice.contains("host slice") && slice.contains("exactly 6 elements"),
        "{slice}"
    );
    assert!(shapes.contains("2x3") && shapes.contains("3x2"), "{shapes}");
    assert!(!shapes.contains("slice"), "{shapes}");
    let before_colon = |s: &str| s.split(':').next().map(str::to_owned);
    assert_ne!(before_colon(&slice), before_colon(&shapes));
    Ok(())
}

/// cudarc's errors convert into `PoolError` with `?`, each kept whole as `source()`; a closure of
/// the caller's own error type can be captured; cuBLAS without its library is a typed error.
/// None of these needs a GPU. (A `DriverError` is never formatted here: its text asks the driver.)
#[cfg(feature = "cuda")]
mod cudarc_errors {
    use gpu_pool::GpuWrite;
    use std::error::Error as _;
    use std::ffi::CString;

    use gpu_pool::interop::cudarc::driver::{DriverError, sys::CUresult};
    use gpu_pool::interop::cudarc::nvrtc::{CompileError, result::NvrtcError, sys::nvrtcResult};
    use gpu_pool::{Device, PoolError, Stream, compat::opencv::BufferPool};

    fn launch() -> Result<(), DriverError> {
        Err(DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED))
    }

    fn pooled_launch() -> Result<(), PoolError> {
        launch()?;
        Ok(())
    }

    #[test]
    fn a_driver_error_converts_with_question_mark_and_stays_its_source() {
        let err = pooled_launch().unwrap_err();
        assert!(matches!(
            err,
            PoolError::Driver {
                call: PoolError::CUDARC_CALL,
                ..
            }
        ));
        let source = err.source().and_then(|e| e.downcast_ref::<DriverError>());
        assert_eq!(
            source.map(|e| e.0),
            Some(CUresult::CUDA_ERROR_LAUNCH_FAILED)
        );
    }

    #[test]
    fn an_nvrtc_compile_error_converts_and_keeps_its_log() {
        let compile = CompileError::CompileError {
            nvrtc: NvrtcError(nvrtcResult::NVRTC_ERROR_COMPILATION),
            options: vec!["--gpu-architecture=sm_90".into()],
            log: CString::new("kernel.cu(3): error: identifier \"x\" is undefined").unwrap(),
        };
        let err = PoolError::from(compile.clone());
        assert!(matches!(err, PoolError::Nvrtc { .. }), "{err}");
        let source = err.source().and_then(|e| e.downcast_ref::<CompileError>());
        assert_eq!(source, Some(&compile));
        let text = err.to_string();
        assert!(text.starts_with("nvrtc failed: "), "{text}");
        assert!(
            text.contains("is undefined"),
            "the log is in the message: {text}"
        );
        assert!(text.contains("fix the kernel source"), "{text}");

        let err = PoolError::from(NvrtcError(nvrtcResult::NVRTC_ERROR_INVALID_INPUT));
        assert!(matches!(err, PoolError::Nvrtc { .. }), "{err}");
        let source = err.source().and_then(|e| e.downcast_ref::<NvrtcError>());
        assert_eq!(
            source.map(|e| e.0),
            Some(nvrtcResult::NVRTC_ERROR_INVALID_INPUT)
        );
    }

    #[cfg(feature = "cublas")]
    #[test]
    fn a_cublas_error_converts_and_stays_its_source() {
        use gpu_pool::interop::cudarc::cublas::{result::CublasError, sys::cublasStatus_t};
        fn gemm() -> Result<(), PoolError> {
            Err(CublasError(cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE))?
        }
        let err = gemm().unwrap_err();
        assert!(matches!(err, PoolError::Cublas { .. }), "{err}");
        let source = err.source().and_then(|e| e.downcast_ref::<CublasError>());
        assert_eq!(
            source.map(|e| e.0),
            Some(cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE)
        );
        let text = err.to_string();
        assert!(text.contains("CUBLAS_STATUS_INVALID_VALUE"), "{text}");
        assert!(text.contains("leading dimensions"), "{text}");
    }

    /// Where `libcublas` cannot be loaded (as on a machine without CUDA), `Stream::cublas` is
    /// `NoCudaLibrary`, not cudarc's panic; where it can, a host stream is `Unsupported`.
    #[cfg(feature = "cublas")]
    #[test]
    fn cublas_without_its_library_is_a_typed_error() -> Result<(), PoolError> {
        let stream = Stream::new(&Device::private_host())?;
        let err = stream.cublas().unwrap_err();
        // SAFETY: only asks whether the library loads.
        if unsafe { gpu_pool::interop::cudarc::cublas::sys::is_culib_present() } {
            assert!(matches!(err, PoolError::Unsupported { .. }), "{err}");
            println!("libcublas present: a host stream is {err}");
        } else {
            assert!(
                matches!(err, PoolError::NoCudaLibrary { library: "cublas" }),
                "{err}"
            );
            let text = err.to_string();
            assert!(text.contains("libcublas.so"), "{text}");
            assert!(text.contains("LD_LIBRARY_PATH"), "{text}");
            println!("no libcublas, as expected here: {err}");
        }
        Ok(())
    }

    /// An error type of the caller's own, as an application defines one.
    #[derive(Debug)]
    enum AppError {
        Pool(PoolError),
        Mine,
    }

    impl From<PoolError> for AppError {
        fn from(e: PoolError) -> Self {
            AppError::Pool(e)
        }
    }

    /// On the host backend a capture is refused before the closure runs: the pool's error comes
    /// back converted into the caller's type. (On a GPU, `cuda.rs` shows the closure's own error
    /// passing through.)
    #[test]
    fn capture_with_converts_the_pools_error_into_the_callers() -> Result<(), PoolError> {
        let stream = Stream::new(&Device::private_host())?;
        let mut ran = false;
        let err = stream
            .capture_with::<AppError>(|s| {
                ran = true;
                BufferPool::new(s).get_buffer_1d::<u8>(8)?.set_to(1)?; // a PoolError, converted
                Err(AppError::Mine)
            })
            .unwrap_err();
        assert!(
            matches!(err, AppError::Pool(PoolError::Unsupported { .. })),
            "{err:?}"
        );
        assert!(!ran, "the closure never ran");
        assert_eq!(stream.stats().stack_in_use, 0, "no fence left behind");
        Ok(())
    }
}

/// A feature's errors are its own type nested in `PoolError`: matched as
/// `PoolError::Ppl(PplError::..)`, shown as the feature's error, and convertible with `?` / `From`.
#[test]
fn a_features_error_is_its_own_type_nested_in_pool_error() {
    use gpu_pool::compat::pplcv::{PplError, PplPool};
    let err = PplPool::new(&Device::private_host(), 0).unwrap_err();
    let PoolError::Ppl(inner) = &err else {
        panic!("not a ppl.cv error: {err:?}");
    };
    assert!(matches!(inner, PplError::State { .. }), "{inner:?}");
    assert_eq!(err.to_string(), inner.to_string());
    assert!(err.to_string().contains("ceil_1d_volume"), "{err}");
    assert_eq!(PoolError::from(inner.clone()), err);
    // The control: a core error is no feature's.
    let core = PoolError::Unsupported {
        device: gpu_pool::DeviceId::Host(0),
        what: "a test",
    };
    assert!(!matches!(core, PoolError::Ppl(_) | PoolError::Capture(_)));
}
