//! Builds the three layers of libbastile.so:
//! - every `cuda/*.cu` into one fatbin (SASS for sm_90a, sm_100f, sm_120f and compute_80 PTX),
//!   embedded through `$OUT_DIR/fatbins.rs`; nvcc runs again only for a file whose inputs changed;
//! - every `include/*.h` (parameter blocks) into Rust structs with bindgen;
//! - the C++ torch registration layer (`src/torch/*.cpp`) and the cxx bridges of `src/*.rs`,
//!   against the torch that `python3` (or `$BASTILE_PYTHON`) imports.
use std::env;
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Targets of the fatbin. The `a`/`f` variants carry the architecture-specific instructions;
/// the PTX lets any later GPU JIT-compile the kernels.
const GENCODE: &[&str] = &[
    "arch=compute_90a,code=sm_90a",
    "arch=compute_100f,code=sm_100f",
    "arch=compute_120f,code=sm_120f",
    "arch=compute_80,code=compute_80",
];

struct Torch {
    version: String,
    cxx11_abi: bool,
    lib_dir: PathBuf,
    include_dirs: Vec<PathBuf>,
    /// site-packages directories, where the pip CUDA toolkit lives (`nvidia/cu13/...`).
    site_dirs: Vec<PathBuf>,
}

fn main() {
    for var in ["BASTILE_PYTHON", "NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "BASTILE_NVCC_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for path in ["cuda", "include", "src"] {
        println!("cargo:rerun-if-changed={path}");
    }
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let torch = query_torch();
    let nvcc = find_nvcc(&torch).unwrap_or_else(|| {
        fail(
            "nvcc not found. Set NVCC or CUDA_HOME, put nvcc on PATH, or install the pip toolkit: \
             pip install 'cuda-toolkit[nvcc,cccl]==13.0.2' nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88",
        )
    });
    let cuda_include = nvcc.parent().unwrap().parent().unwrap().join("include");

    compile_kernels(&nvcc, &out);
    generate_params(&out);
    compile_torch_layer(&torch, &cuda_include);

    println!("cargo:rustc-env=BASTILE_TORCH_VERSION={}", torch.version);
    println!("cargo:rustc-link-search=native={}", torch.lib_dir.display());
    for lib in ["c10", "c10_cuda", "torch_cpu", "torch"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // torch is already loaded when Python loads us; the rpath serves `cargo test` binaries.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", torch.lib_dir.display());
}

fn fail(msg: &str) -> ! {
    eprintln!("error: bastile build: {msg}");
    std::process::exit(1)
}

fn python() -> String {
    env::var("BASTILE_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn query_torch() -> Torch {
    let script = "import site, sys, torch, torch.utils.cpp_extension as c\n\
                  print(torch.__version__)\n\
                  print(int(torch._C._GLIBCXX_USE_CXX11_ABI))\n\
                  print(c.library_paths()[0])\n\
                  print(';'.join(c.include_paths()))\n\
                  print(';'.join(p for p in sys.path if p.endswith('-packages')))";
    let py = python();
    let output = Command::new(&py).args(["-c", script]).output();
    let output = match output {
        Ok(o) if o.status.success() => o,
        Ok(o) => fail(&format!(
            "`{py}` could not import torch (set BASTILE_PYTHON to the interpreter that has it):\n{}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => fail(&format!("could not run `{py}`: {e}")),
    };
    let text = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let paths = |s: &str| s.split(';').filter(|p| !p.is_empty()).map(PathBuf::from).collect();
    Torch {
        version: lines[0].to_string(),
        cxx11_abi: lines[1] == "1",
        lib_dir: PathBuf::from(lines[2]),
        include_dirs: paths(lines[3]),
        site_dirs: paths(lines.get(4).copied().unwrap_or("")),
    }
}

fn find_nvcc(torch: &Torch) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = env::var("NVCC") {
        candidates.push(p.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = env::var(var) {
            candidates.push(Path::new(&home).join("bin/nvcc"));
        }
    }
    if let Ok(path) = env::var("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    for site in &torch.site_dirs {
        candidates.push(site.join("nvidia/cu13/bin/nvcc"));
    }
    candidates.push("/usr/local/cuda/bin/nvcc".into());
    candidates.into_iter().find(|p| p.is_file())
}

/// The files of `dir` ending in `.ext`, sorted so that builds are reproducible.
fn sources(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("reading {}: {e}", path.display())))
}

fn compile_kernels(nvcc: &Path, out: &Path) {
    let mut args: Vec<String> = ["-fatbin", "-O3", "-std=c++17", "-Iinclude", "-Icuda", "-Xptxas=-warn-spills"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(GENCODE.iter().map(|g| format!("-gencode={g}")));
    if let Ok(extra) = env::var("BASTILE_NVCC_FLAGS") {
        args.extend(extra.split_whitespace().map(String::from));
    }
    // What every kernel file may include; a change to any of them recompiles them all.
    let mut shared = DefaultHasher::new();
    (nvcc, &args).hash(&mut shared);
    for h in sources("cuda", "cuh").iter().chain(&sources("include", "h")) {
        read(h).hash(&mut shared);
    }
    let mut rust = String::new();
    for src in &sources("cuda", "cu") {
        let stem = src.file_stem().unwrap().to_str().unwrap();
        let fatbin = out.join(format!("{stem}.fatbin"));
        let stamp = out.join(format!("{stem}.fatbin.inputs"));
        let mut hasher = shared.clone();
        read(src).hash(&mut hasher);
        let inputs = format!("{:016x}", hasher.finish());
        if !(fatbin.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == inputs)) {
            let status = Command::new(nvcc)
                .args(&args)
                .arg(src)
                .arg("-o")
                .arg(&fatbin)
                .status()
                .unwrap_or_else(|e| fail(&format!("could not run {}: {e}", nvcc.display())));
            if !status.success() {
                fail(&format!("nvcc failed on {}", src.display()));
            }
            std::fs::write(&stamp, inputs).unwrap();
        }
        writeln!(
            rust,
            "pub static {}: &crate::driver::Fatbin = &crate::driver::Fatbin(*include_bytes!({:?}));",
            stem.to_uppercase(),
            fatbin.display().to_string()
        )
        .unwrap();
    }
    let all: Vec<String> = sources("cuda", "cu").iter().map(|s| s.file_stem().unwrap().to_str().unwrap().to_uppercase()).collect();
    writeln!(rust, "pub static ALL: &[&crate::driver::Fatbin] = &[{}];", all.join(", ")).unwrap();
    std::fs::write(out.join("fatbins.rs"), rust).unwrap();
}

fn generate_params(out: &Path) {
    let headers: String = sources("include", "h").iter().map(|h| format!("#include \"{}\"\n", h.display())).collect();
    bindgen::Builder::default()
        .header_contents("params.h", &headers)
        .clang_arg("-Iinclude")
        .allowlist_file(".*include/.*\\.h")
        .rustified_enum("BastileDType")
        .derive_default(true)
        .derive_partialeq(true)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen on include/*.h: {e} (apt-get install libclang-dev)")))
        .write_to_file(out.join("params.rs"))
        .unwrap();
}

fn compile_torch_layer(torch: &Torch, cuda_include: &Path) {
    // Each kernel family declares its C++-callable entries in its own module's bridge.
    let bridges = sources("src", "rs")
        .into_iter()
        .filter(|f| std::fs::read_to_string(f).unwrap().contains("#[cxx::bridge"));
    let mut build = cxx_build::bridges(bridges);
    build
        .files(sources("src/torch", "cpp"))
        .include("include")
        .include("src/torch")
        .includes(&torch.include_dirs)
        .include(cuda_include)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", if torch.cxx11_abi { "1" } else { "0" })
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        // Nothing references the registrations by name; keep every object so their static
        // initialisers (TORCH_LIBRARY) make it into the library.
        .link_lib_modifier("+whole-archive")
        .opt_level(2)
        .compile("bastile_torch");
}
