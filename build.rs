//! Builds the three layers of libbastile.so:
//! - every `cuda/*.cu` into one fatbin (SASS for sm_90a, sm_100f, sm_120f and compute_80 PTX),
//!   embedded; nvcc runs again only for a file whose own inputs (it and what it includes) changed, the
//!   files in parallel with each other and with the C++ layer, as many jobs at once as cargo's jobserver
//!   allows (`-j`, the cores by default);
//! - every `include/*.h` (parameter blocks) into Rust structs with bindgen, and their kernel lists
//!   (`<BLOCK>_KERNELS(K)`) and decision blocks (`<BLOCK>_DECISION`) into Rust tables of kernel names
//!   and ids (`kernels.rs`) and C++ block ids (`blocks.h`);
//! - the C++ torch registration layer (`src/torch/*.cpp`) and the cxx bridge (`src/ffi.rs`), against
//!   the torch that `python3` (or `$BASTILE_PYTHON`) imports.
//!
//! An op is found by its files: `cuda/<op>.cu`, `include/<op>.h`, `src/<op>.rs` (a module
//! of the crate, declared in the generated `ops.rs`) and `src/torch/<op>.cpp`. There is no list to extend.
use std::collections::BTreeSet;
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
    /// Its intra-op thread pool is OpenMP's (libgomp), which the CPU kernels run on.
    openmp: bool,
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
    println!("cargo:rustc-env=BASTILE_CUDA_VERSION={}", cuda_version(&nvcc));

    let ops = stems("cuda", "cu");
    let kernels = Kernels::new(&nvcc, &out, &ops);
    let jobs = jobserver();
    std::thread::scope(|s| {
        // Each worker holds a token of cargo's while it runs nvcc; this thread, on the build script's own
        // token, builds the C++ layer (cc's further jobs take tokens too), then compiles what is left.
        for _ in 0..kernels.pending.len() {
            s.spawn(|| {
                let _token = jobs.acquire().unwrap_or_else(|e| fail(&format!("waiting for a job slot: {e}")));
                kernels.compile_next();
            });
        }
        generate_params(&out);
        generate_kernel_tables(&out, &ops);
        generate_op_modules(&out, &ops);
        compile_torch_layer(&torch, &cuda_include, &out);
        while kernels.compile_next() {}
    });
    kernels.write_table(&out, &ops);

    println!("cargo:rustc-env=BASTILE_TORCH_VERSION={}", torch.version);
    println!("cargo:rustc-env=BASTILE_TORCH_CXX11_ABI={}", u8::from(torch.cxx11_abi));
    println!("cargo:rustc-link-search=native={}", torch.lib_dir.display());
    for lib in ["c10", "c10_cuda", "torch_cpu", "torch"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    if torch.openmp {
        // The libgomp torch ships (or the system's, which it then uses): one OpenMP runtime, one pool.
        println!("cargo:rustc-link-lib=dylib:+verbatim=libgomp.so.1");
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
                  print(int(torch.backends.openmp.is_available()))\n\
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
        openmp: lines[2] == "1",
        lib_dir: PathBuf::from(lines[3]),
        include_dirs: paths(lines[4]),
        site_dirs: paths(lines.get(5).copied().unwrap_or("")),
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

/// The CUDA release of `nvcc` ("13.0"), which the driver must support to load the kernels it compiles.
fn cuda_version(nvcc: &Path) -> String {
    let output = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| fail(&format!("could not run {}: {e}", nvcc.display())));
    let text = String::from_utf8_lossy(&output.stdout);
    text.split_once("release ")
        .and_then(|(_, rest)| rest.split(',').next())
        .map(str::to_string)
        .unwrap_or_else(|| fail(&format!("no `release X.Y` in `{} --version`:\n{text}", nvcc.display())))
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

fn stems(dir: &str, ext: &str) -> Vec<String> {
    sources(dir, ext).iter().map(|p| p.file_stem().unwrap().to_str().unwrap().to_string()).collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("reading {}: {e}", path.display())))
}

/// `file` and every file it includes in quotes from cuda/ or include/, recursively: what a kernel file is
/// compiled from, besides nvcc and its flags.
fn included(file: &Path, files: &mut BTreeSet<PathBuf>) {
    if !files.insert(file.to_path_buf()) {
        return;
    }
    for line in read(file).lines() {
        let Some(name) = line.trim_start().strip_prefix("#include \"").and_then(|l| l.split('"').next()) else { continue };
        if let Some(path) = ["cuda", "include"].iter().map(|d| Path::new(d).join(name)).find(|p| p.is_file()) {
            included(&path, files);
        }
    }
}

/// cargo's jobserver (the build script holds one token of its own besides those it acquires), or one of as
/// many tokens as cores outside cargo.
fn jobserver() -> jobserver::Client {
    // SAFETY: called once, before any thread starts, on the descriptors cargo passed to this process.
    unsafe { jobserver::Client::from_env() }.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        jobserver::Client::new(cores).unwrap_or_else(|e| fail(&format!("creating a jobserver: {e}")))
    })
}

/// The nvcc runs a build needs: the `.cu` files whose fatbin is missing or was made from other inputs.
struct Kernels<'a> {
    nvcc: &'a Path,
    args: Vec<String>,
    /// (source, fatbin, stamp file, hash of its inputs)
    pending: Vec<(PathBuf, PathBuf, PathBuf, String)>,
    next: std::sync::atomic::AtomicUsize,
}

impl<'a> Kernels<'a> {
    fn new(nvcc: &'a Path, out: &Path, ops: &[String]) -> Self {
        let mut args: Vec<String> = ["-fatbin", "-O3", "-std=c++17", "-Iinclude", "-Icuda", "-Xptxas=-warn-spills"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(GENCODE.iter().map(|g| format!("-gencode={g}")));
        if let Ok(extra) = env::var("BASTILE_NVCC_FLAGS") {
            args.extend(extra.split_whitespace().map(String::from));
        }
        let mut pending = Vec::new();
        for stem in ops {
            let src = PathBuf::from(format!("cuda/{stem}.cu"));
            let fatbin = out.join(format!("{stem}.fatbin"));
            let stamp = out.join(format!("{stem}.fatbin.inputs"));
            let mut hasher = DefaultHasher::new();
            (nvcc, &args).hash(&mut hasher);
            let mut files = BTreeSet::new();
            included(&src, &mut files);
            for f in &files {
                (f, read(f)).hash(&mut hasher);
            }
            let inputs = format!("{:016x}", hasher.finish());
            if !(fatbin.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == inputs)) {
                pending.push((src, fatbin, stamp, inputs));
            }
        }
        Kernels { nvcc, args, pending, next: Default::default() }
    }

    /// Compiles the next pending file, if one is left (false otherwise).
    fn compile_next(&self) -> bool {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some((src, fatbin, stamp, inputs)) = self.pending.get(i) else { return false };
        let output = Command::new(self.nvcc)
            .args(&self.args)
            .arg(src)
            .arg("-o")
            .arg(fatbin)
            .output()
            .unwrap_or_else(|e| fail(&format!("could not run {}: {e}", self.nvcc.display())));
        // A file's diagnostics in one piece: the jobs' outputs would interleave.
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
        if !output.status.success() {
            fail(&format!("nvcc failed on {}", src.display()));
        }
        std::fs::write(stamp, inputs).unwrap();
        true
    }

    /// `fatbins.rs`: each op's fatbin embedded, and the list of them all.
    fn write_table(&self, out: &Path, ops: &[String]) {
        let mut rust = String::new();
        for stem in ops {
            let fatbin = out.join(format!("{stem}.fatbin"));
            writeln!(
                rust,
                "pub static {}: &crate::driver::Fatbin = &crate::driver::Fatbin(*include_bytes!({:?}));",
                stem.to_uppercase(),
                fatbin.display().to_string()
            )
            .unwrap();
        }
        let all: Vec<String> = ops.iter().map(|s| s.to_uppercase()).collect();
        writeln!(rust, "pub static ALL: &[&crate::driver::Fatbin] = &[{}];", all.join(", ")).unwrap();
        std::fs::write(out.join("fatbins.rs"), rust).unwrap();
    }
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

/// A parameter block that kernels take, with the kernels its header lists; or a decision (no kernels): a
/// block the C++ layer fills with a question and Rust completes with its answer (`Decide`).
struct Block {
    /// The C struct, `SwigluForward`.
    name: String,
    /// The op (header and `.cu` file) it belongs to, `swiglu`.
    op: String,
    /// Each kernel's tags; its name is `<op>_<tag>_<tag>...`. Empty for a decision.
    kernels: BTreeSet<Vec<String>>,
}

/// `SWIGLU_FORWARD` -> `SwigluForward`.
fn camel(upper: &str) -> String {
    upper
        .split('_')
        .map(|w| w.chars().next().into_iter().chain(w.chars().skip(1).flat_map(char::to_lowercase)).collect::<String>())
        .collect()
}

/// `Bf16`, `CastAfterWeight`: a tag as a Rust enum variant.
fn variant(tag: &str) -> String {
    camel(&tag.to_uppercase())
}

/// Reads every `#define <BLOCK>_KERNELS(K, ...)` of `include/<op>.h`: each parameter's expansion is
/// collected through the C preprocessor, one `K(tags...)` per kernel. `#define <BLOCK>_DECISION` declares
/// a decision block. Kernel blocks come first, each kind sorted by name: their ids.
fn kernel_lists(ops: &[String]) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut decisions = Vec::new();
    for op in ops {
        let header = PathBuf::from(format!("include/{op}.h"));
        let mut probe = format!("#include \"{op}.h\"\n#define BASTILE_KERNEL(...) bastile_kernel(__VA_ARGS__);\n");
        let mut lists = 0;
        for line in read(&header).lines() {
            let Some(rest) = line.trim_start().strip_prefix("#define ") else { continue };
            if let Some(block) = rest.trim().strip_suffix("_DECISION") {
                decisions.push(Block { name: camel(block), op: op.clone(), kernels: BTreeSet::new() });
                continue;
            }
            let Some((macro_name, params)) = rest.split_once('(') else { continue };
            let Some(block) = macro_name.strip_suffix("_KERNELS") else { continue };
            let arity = params.split(')').next().unwrap().split(',').count();
            let collectors = vec!["BASTILE_KERNEL"; arity].join(", ");
            writeln!(probe, "bastile_block(\"{block}\");\n{macro_name}({collectors})").unwrap();
            lists += 1;
        }
        let probe_path = PathBuf::from(env::var("OUT_DIR").unwrap()).join(format!("{op}_kernels.c"));
        std::fs::write(&probe_path, probe).unwrap();
        let expanded = cc::Build::new().file(&probe_path).include("include").cargo_warnings(false).expand();
        let mut found: Vec<Block> = Vec::new();
        for stmt in String::from_utf8(expanded).unwrap().split(';') {
            if let Some((_, block)) = stmt.rsplit_once("bastile_block(\"") {
                let block = block.trim().trim_end_matches("\")");
                found.push(Block { name: camel(block), op: op.clone(), kernels: BTreeSet::new() });
            } else if let Some((_, tags)) = stmt.rsplit_once("bastile_kernel(") {
                // Empty tags (a list's optional part left out) are no part of the name.
                let tags: Vec<String> =
                    tags.trim().trim_end_matches(')').split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect();
                if let Some(bad) = tags.iter().find(|t| !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')) {
                    fail(&format!("{}: kernel tag `{bad}` is not an identifier", header.display()));
                }
                found.last_mut().unwrap().kernels.insert(tags);
            }
        }
        if lists == 0 || found.len() != lists || found.iter().any(|b| b.kernels.is_empty()) {
            fail(&format!("{} must declare each parameter block's kernels as `#define <BLOCK>_KERNELS(K)`, \
                           one K(tags...) per kernel", header.display()));
        }
        blocks.extend(found);
    }
    blocks.sort_by(|a, b| a.name.cmp(&b.name));
    decisions.sort_by(|a, b| a.name.cmp(&b.name));
    blocks.extend(decisions);
    blocks
}

/// `kernels.rs` (Rust): the `Tag` enum of every word kernel names are made of, and for each block its
/// kernels sorted by tags, with their names; `for_block`, which runs a generic visitor for a block id.
/// `blocks.h` (C++): the same ids by parameter type.
fn generate_kernel_tables(out: &Path, ops: &[String]) {
    let blocks = kernel_lists(ops);
    // Every dtype is a tag, float64 included: a CUDA lookup for it names the dtype in its error.
    let mut tags: BTreeSet<String> = ["f32", "f16", "bf16", "f64"].iter().map(|s| s.to_string()).collect();
    tags.extend(blocks.iter().flat_map(|b| b.kernels.iter().flatten().cloned()));
    let mut rs = String::from(
        "/// A word of a kernel's name (`swiglu_fwd_bf16_vec`: `Fwd`, `Bf16`, `Vec`), from the kernel lists of\n\
         /// include/*.h. Declared in the order of their spelling, so that tag lists sort as their names.\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]\npub enum Tag {\n",
    );
    for t in &tags {
        writeln!(rs, "    {},", variant(t)).unwrap();
    }
    rs.push_str("}\n\nimpl Tag {\n    pub fn name(self) -> &'static str {\n        match self {\n");
    for t in &tags {
        writeln!(rs, "            Tag::{} => {t:?},", variant(t)).unwrap();
    }
    rs.push_str("        }\n    }\n}\n\n");
    let mut cpp = String::from(
        "// Generated by build.rs: the id by which the Rust bridge knows each parameter or decision block.\n\
         #pragma once\n#include <cstdint>\n\n",
    );
    for op in ops {
        writeln!(cpp, "#include \"{op}.h\"").unwrap();
    }
    cpp.push_str("\nnamespace bastile {\n\ntemplate <class P> struct Block;\n");
    let (mut dispatch, mut decide) = (String::new(), String::new());
    for (id, b) in blocks.iter().enumerate() {
        writeln!(
            cpp,
            "template <> struct Block<::{}> {{\n  static constexpr uint32_t id = {id};\n  static constexpr const char* op = \"{}\";\n}};",
            b.name, b.op
        )
        .unwrap();
        if b.kernels.is_empty() {
            writeln!(rs, "impl Decision for crate::params::{} {{\n    const ID: u32 = {id};\n}}\n", b.name).unwrap();
            writeln!(decide, "        {id} => Ok(visit.visit::<crate::params::{}>()),", b.name).unwrap();
            continue;
        }
        writeln!(rs, "impl Kernels for crate::params::{} {{", b.name).unwrap();
        writeln!(rs, "    const OP: &'static str = {:?};", b.op).unwrap();
        writeln!(rs, "    const ID: u32 = {id};").unwrap();
        writeln!(rs, "    const FATBIN: &'static crate::driver::Fatbin = crate::driver::fatbins::{};", b.op.to_uppercase())
            .unwrap();
        rs.push_str("    const KERNELS: &'static [(&'static [Tag], &'static str)] = &[\n");
        for k in &b.kernels {
            let list: Vec<String> = k.iter().map(|t| format!("Tag::{}", variant(t))).collect();
            writeln!(rs, "        (&[{}], \"{}_{}\"),", list.join(", "), b.op, k.join("_")).unwrap();
        }
        rs.push_str("    ];\n}\n\n");
        writeln!(dispatch, "        {id} => Ok(visit.visit::<crate::params::{}>()),", b.name).unwrap();
    }
    write!(
        rs,
        "/// Runs `visit` with the parameter block whose id is `id`.\n\
         pub fn for_block<V: Visit>(id: u32, visit: V) -> std::result::Result<V::Out, String> {{\n    match id {{\n{dispatch}        \
         _ => Err(format!(\"bastile: no parameter block has id {{id}}\")),\n    }}\n}}\n\n\
         /// Runs `visit` with the decision block whose id is `id`.\n\
         pub fn for_decision<V: VisitDecision>(id: u32, visit: V) -> std::result::Result<V::Out, String> {{\n    match id {{\n{decide}        \
         _ => Err(format!(\"bastile: no decision block has id {{id}}\")),\n    }}\n}}\n"
    )
    .unwrap();
    cpp.push_str("\n}  // namespace bastile\n");
    std::fs::write(out.join("kernels.rs"), rs).unwrap();
    std::fs::create_dir_all(out.join("include")).unwrap();
    std::fs::write(out.join("include/blocks.h"), cpp).unwrap();
}

/// `ops.rs`: the crate module `src/<op>.rs` of each op.
fn generate_op_modules(out: &Path, ops: &[String]) {
    let dir = env::current_dir().unwrap().join("src");
    let mods: String = ops
        .iter()
        .map(|op| format!("#[path = {:?}]\npub mod {op};\n", dir.join(format!("{op}.rs")).display().to_string()))
        .collect();
    std::fs::write(out.join("ops.rs"), mods).unwrap();
}

fn compile_torch_layer(torch: &Torch, cuda_include: &Path, out: &Path) {
    let mut build = cxx_build::bridge("src/ffi.rs");
    if torch.openmp {
        // at::parallel_for (src/torch/parallel.h) is OpenMP code, inlined from torch's headers.
        build.flag("-fopenmp");
    }
    build
        .files(sources("src/torch", "cpp"))
        .include("include")
        .include("src/torch")
        .include(out.join("include"))
        .includes(&torch.include_dirs)
        .include(cuda_include)
        .std("c++20")
        .define("_GLIBCXX_USE_CXX11_ABI", if torch.cxx11_abi { "1" } else { "0" })
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        // Parameter blocks are filled by designated initializers; the fields left out are Rust's to plan.
        .flag_if_supported("-Wno-missing-field-initializers")
        // Nothing references the registrations by name; keep every object so their static
        // initialisers (TORCH_LIBRARY) make it into the library.
        .link_lib_modifier("+whole-archive")
        .opt_level(2)
        .compile("bastile_torch");
}
