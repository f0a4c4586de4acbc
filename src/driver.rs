//! The CUDA driver, loaded at run time through cudarc so that the library loads (and its CPU ops
//! work) on machines with no GPU. Kernels run in torch's primary context on torch's current stream;
//! modules and functions are loaded once per device and cached.
use cudarc::driver::sys::{
    self, CUcontext, CUdevice_attribute, CUfunction, CUfunction_attribute, CUmodule, CUresult, CUstream,
};
use crate::params::BastileTensorMap;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Mutex, OnceLock};

pub type Result<T> = std::result::Result<T, String>;

/// A fatbin embedded by build.rs; the driver wants its image aligned.
#[repr(C, align(64))]
pub struct Fatbin<T: ?Sized = [u8]>(pub T);

/// The fatbin of every op, named after its `cuda/*.cu` file, and `ALL` of them.
pub mod fatbins {
    include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));
}

fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::os::raw::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    unsafe { sys::cuGetErrorName(r, &mut name) };
    let name = if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: non-null names from the driver are NUL-terminated static strings.
        unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned()
    };
    Err(format!("bastile: {what} failed: {name}"))
}

/// The CUDA release whose nvcc compiled the kernels (build.rs): the driver must support it.
const KERNELS_CUDA: &str = env!("BASTILE_CUDA_VERSION");

/// Loads libcuda and initialises it once; the error says why CUDA is unusable.
pub fn available() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes for the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("bastile: the CUDA driver (libcuda.so) could not be loaded: \
                        CUDA tensors need an NVIDIA driver on this machine"
                .into());
        }
        let mut version = 0;
        // SAFETY: plain driver calls.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        check(unsafe { sys::cuDriverGetVersion(&mut version) }, "cuDriverGetVersion")?;
        supports_kernels(version, KERNELS_CUDA)
    })
    .clone()
}

/// Whether a driver of CUDA version `driver` (cuDriverGetVersion's 1000 * major + 10 * minor) loads
/// kernels compiled by CUDA `kernels` ("13.0"): their PTX needs a driver of that release or newer.
fn supports_kernels(driver: i32, kernels: &str) -> Result<()> {
    let release = kernels.split_once('.').and_then(|(major, minor)| Some((major.parse::<i32>().ok()?, minor.parse::<i32>().ok()?)));
    let (major, minor) = release.expect("build.rs records the CUDA release as X.Y");
    let needed = major * 1000 + minor * 10;
    if driver >= needed {
        return Ok(());
    }
    Err(format!(
        "bastile: the NVIDIA driver supports CUDA {}.{}, but Bastile's kernels were compiled by CUDA {kernels} \
         and need a driver for CUDA {kernels} or newer (for CUDA 13.0, the toolkit Bastile pins: the R580 \
         branch, on Linux 580.65.06 or newer); update the NVIDIA driver",
        driver / 1000,
        driver % 1000 / 10
    ))
}

/// One GPU as torch uses it: its primary context and what has been loaded into it.
pub struct Device {
    ctx: CUcontext,
    sm_count: u32,
    /// Compute capability, major and minor.
    capability: (u32, u32),
    shared: SharedMemory,
    modules: Mutex<HashMap<usize, CUmodule>>,
    functions: Mutex<HashMap<KernelKey, Kernel>>,
}

/// What a loaded kernel is cached under: its parameter block's id and its index in that block's kernel
/// table (src/kernels.rs), and the threads and `sharing` its occupancy was computed for.
pub type KernelKey = (u32, u32, u32, u32);

// SAFETY: driver handles may be used from any thread; the maps are behind mutexes.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

/// A loaded kernel, how many of its blocks (of the size it was looked up with) fit on one SM, and the
/// dynamic shared memory each block may take (0 unless looked up with `kernel_sharing`).
#[derive(Clone, Copy)]
pub struct Kernel {
    pub function: CUfunction,
    pub blocks_per_sm: u32,
    pub shared: u32,
}

/// An SM's shared memory as the driver reports it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedMemory {
    pub per_sm: u32,
    /// The most one block may opt in to.
    pub per_block: u32,
    /// Taken by the system from every resident block.
    pub reserved: u32,
}

impl SharedMemory {
    /// Dynamic shared memory a block may take so that `blocks` of them share an SM, given the static
    /// shared memory of its kernel.
    pub fn room(&self, blocks: u32, static_bytes: u32) -> u32 {
        (self.per_sm / blocks.max(1)).saturating_sub(self.reserved).min(self.per_block).saturating_sub(static_bytes)
    }
}

/// One slot per visible GPU, opened on first use.
fn slots() -> Result<&'static [OnceLock<Result<Device>>]> {
    static DEVICES: OnceLock<Result<Vec<OnceLock<Result<Device>>>>> = OnceLock::new();
    DEVICES
        .get_or_init(|| {
            available()?;
            let mut n = 0;
            // SAFETY: plain driver call.
            check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
            Ok((0..n).map(|_| OnceLock::new()).collect())
        })
        .as_ref()
        .map(|v| v.as_slice())
        .map_err(Clone::clone)
}

pub fn device(ordinal: i32) -> Result<&'static Device> {
    let slots = slots()?;
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|i| slots.get(i))
        .ok_or_else(|| format!("bastile: CUDA device {ordinal} does not exist ({} visible)", slots.len()))?;
    slot.get_or_init(|| Device::open(ordinal)).as_ref().map_err(Clone::clone)
}

impl Device {
    fn open(ordinal: i32) -> Result<Self> {
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain driver calls with out-pointers to locals. Retaining the primary context
        // (torch's) keeps it alive for the life of the process.
        unsafe {
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        }
        let attribute = |a: CUdevice_attribute| -> Result<u32> {
            let mut v = 0;
            // SAFETY: plain driver call with an out-pointer to a local.
            check(unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) }, "cuDeviceGetAttribute")?;
            Ok(v.max(0) as u32)
        };
        use CUdevice_attribute::*;
        let shared = SharedMemory {
            per_sm: attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
            per_block: attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            reserved: attribute(CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
        };
        Ok(Device {
            ctx,
            sm_count: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            capability: (
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            shared,
            modules: Mutex::default(),
            functions: Mutex::default(),
        })
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    pub fn capability(&self) -> (u32, u32) {
        self.capability
    }

    /// Makes torch's primary context current on this thread (a no-op when it already is).
    fn make_current(&self) -> Result<()> {
        let mut cur = std::ptr::null_mut();
        // SAFETY: plain driver calls.
        unsafe {
            check(sys::cuCtxGetCurrent(&mut cur), "cuCtxGetCurrent")?;
            if cur != self.ctx {
                check(sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")?;
            }
        }
        Ok(())
    }

    /// Kernel `name` of `fatbin` for blocks of `threads` threads, cached under `key` (src/kernels.rs
    /// looks kernels up by their tags). With `sharing` > 0 the kernel takes dynamic shared memory:
    /// `sharing` of its blocks are to share an SM, and each may take the room that leaves
    /// (`Kernel::shared`).
    pub fn kernel(
        &self,
        fatbin: &'static Fatbin,
        key: KernelKey,
        name: &str,
        threads: u32,
        sharing: u32,
    ) -> Result<Kernel> {
        self.make_current()?;
        if let Some(k) = self.functions.lock().unwrap().get(&key) {
            return Ok(*k);
        }
        let module = self.module(fatbin)?;
        let cname = CString::new(name).unwrap();
        let mut function = std::ptr::null_mut();
        let mut blocks = 0;
        let mut shared = 0;
        // SAFETY: module is loaded in this context; out-pointers are locals.
        unsafe {
            check(sys::cuModuleGetFunction(&mut function, module, cname.as_ptr()), &format!("loading kernel {name}"))?;
            if sharing > 0 {
                let mut static_bytes = 0;
                check(
                    sys::cuFuncGetAttribute(
                        &mut static_bytes,
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                        function,
                    ),
                    "cuFuncGetAttribute",
                )?;
                shared = self.shared.room(sharing, static_bytes.max(0) as u32);
                check(
                    sys::cuFuncSetAttribute(
                        function,
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared as i32,
                    ),
                    "cuFuncSetAttribute",
                )?;
            }
            check(
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut blocks, function, threads as i32, shared as usize),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )?;
        }
        let k = Kernel { function, blocks_per_sm: blocks.max(1) as u32, shared };
        self.functions.lock().unwrap().insert(key, k);
        Ok(k)
    }

    /// Loads every op's module now, so that no first call pays for it.
    pub fn load_all(&self) -> Result<()> {
        self.make_current()?;
        fatbins::ALL.iter().try_for_each(|f| self.module(f).map(|_| ()))
    }

    fn module(&self, fatbin: &'static Fatbin) -> Result<CUmodule> {
        let mut modules = self.modules.lock().unwrap();
        let id = fatbin as *const Fatbin as *const u8 as usize;
        if let Some(m) = modules.get(&id) {
            return Ok(*m);
        }
        let mut module = std::ptr::null_mut();
        // SAFETY: the image is a complete fatbin embedded for the life of the process.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, fatbin.0.as_ptr().cast()) },
            "cuModuleLoadData (does this GPU have a Bastile kernel image? sm_80 or newer is needed)",
        )?;
        modules.insert(id, module);
        Ok(module)
    }
}

/// Forgets the kernels looked up on every opened device, with the occupancy each launch geometry
/// was derived from; the next launch asks the driver again. Modules stay loaded.
pub fn clear_kernel_cache() {
    if let Ok(slots) = slots() {
        for dev in slots.iter().filter_map(|s| s.get()).filter_map(|d| d.as_ref().ok()) {
            dev.functions.lock().unwrap().clear();
        }
    }
}

/// The TMA descriptor of a row-major bf16 matrix [rows, cols] at `data` (16-byte aligned rows), read in
/// boxes of `box_cols` x `box_rows` with 128-byte swizzling (a box row is 128 bytes); reads outside the
/// matrix give zeros.
pub fn tensor_map_bf16(data: *const c_void, rows: i64, cols: i64, box_cols: u32, box_rows: u32) -> Result<BastileTensorMap> {
    use sys::{CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle};
    let mut map = BastileTensorMap::default();
    let dims = [cols as u64, rows as u64];
    let strides = [cols as u64 * 2];
    let boxes = [box_cols, box_rows];
    let steps = [1u32, 1];
    // SAFETY: BastileTensorMap has CUtensorMap's size and alignment; the other arguments are locals.
    check(
        unsafe {
            sys::cuTensorMapEncodeTiled(
                (&mut map as *mut BastileTensorMap).cast(),
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                data as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        },
        "cuTensorMapEncodeTiled",
    )?;
    Ok(map)
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32),
    pub block: (u32, u32),
    pub shared: u32,
}

/// Launches `kernel` with a single by-value parameter block on `stream` (torch's `cudaStream_t`).
///
/// # Safety
/// `params` must be the parameter type the kernel was compiled for, and every pointer in it must
/// be valid for the accesses the kernel makes.
pub unsafe fn launch<P>(kernel: Kernel, cfg: LaunchConfig, stream: usize, params: &P) -> Result<()> {
    let mut args = [params as *const P as *mut c_void];
    check(
        sys::cuLaunchKernel(
            kernel.function,
            cfg.grid.0,
            cfg.grid.1,
            1,
            cfg.block.0,
            cfg.block.1,
            1,
            cfg.shared,
            stream as CUstream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
        "cuLaunchKernel",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without libcuda the error must say so; with it, device 0 opens and reports its SMs.
    #[test]
    fn device_reports_driver_state() {
        // SAFETY: only probes for the library.
        let present = unsafe { sys::is_culib_present() };
        match device(0) {
            Err(e) if !present => assert!(e.contains("CUDA driver"), "unexpected error: {e}"),
            Err(e) => assert!(e.contains("cuInit") || e.contains("does not exist"), "unexpected error: {e}"),
            Ok(d) => {
                assert!(present);
                assert!(d.sm_count() > 0);
            }
        }
    }

    /// H100 figures: 228 KiB an SM, 227 KiB a block at most, 1 KiB reserved per block.
    #[test]
    fn shared_memory_room() {
        let h100 = SharedMemory { per_sm: 233_472, per_block: 232_448, reserved: 1024 };
        assert_eq!(h100.room(2, 256), 233_472 / 2 - 1024 - 256);
        assert_eq!(h100.room(1, 256), 232_448 - 256);
        assert_eq!(h100.room(0, 0), 232_448);
        assert_eq!(SharedMemory { per_sm: 1024, per_block: 1024, reserved: 1024 }.room(2, 256), 0);
    }

    #[test]
    fn driver_older_than_the_kernels_cuda_is_refused() {
        for (driver, kernels) in [(13000, "13.0"), (13020, "13.0"), (14000, "13.0"), (13010, "13.1")] {
            assert!(supports_kernels(driver, kernels).is_ok(), "{driver} {kernels}");
        }
        let e = supports_kernels(12080, "13.0").unwrap_err();
        assert!(e.contains("supports CUDA 12.8, but Bastile's kernels were compiled by CUDA 13.0"), "{e}");
        assert!(e.contains("580.65.06") && e.contains("update the NVIDIA driver"), "{e}");
        assert!(supports_kernels(13000, "13.1").unwrap_err().contains("supports CUDA 13.0"));
    }

    #[test]
    fn fatbins_are_embedded_and_aligned() {
        assert!(fatbins::ALL.iter().any(|b| std::ptr::eq(*b, fatbins::RMS_NORM)));
        for bin in fatbins::ALL {
            assert!(bin.0.len() > 1024);
            assert_eq!(bin.0.as_ptr() as usize % 64, 0);
            // Fatbin container magic (0xBA55ED50, little endian).
            assert_eq!(&bin.0[..4], &[0x50, 0xED, 0x55, 0xBA]);
        }
    }
}
