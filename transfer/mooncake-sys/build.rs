//! Generates the bindings of Mooncake Transfer Engine's C API with bindgen
//! from the `transfer_engine_c.h` the user points at, and links the library
//! beside it.
//!
//! Neither PyPI nor Debian ships the library with its C API (the wheel
//! `mooncake-transfer-engine-non-cuda` has only a Python extension), so it
//! comes from a Mooncake build of the user's own (docs/transfer.md says how).
//! This crate is a workspace member, so it must build without the library
//! too: then it binds nothing and tells its dependent why (`links` metadata,
//! `DEP_TRANSFER_ENGINE_MISSING`); connex-transfer's build script turns that
//! into the build error when its `mooncake` feature is on. When found, the
//! library's folder travels as `DEP_TRANSFER_ENGINE_LIB_DIR` (for an rpath).

use std::path::{Path, PathBuf};

const HOW: &str = "Set MOONCAKE_LIB_DIR to the folder that holds libtransfer_engine.so \
(Mooncake Transfer Engine's C library, built from github.com/kvcache-ai/Mooncake, folder \
mooncake-transfer-engine; the PyPI wheel has no C API) and MOONCAKE_INCLUDE_DIR to the folder \
that holds its transfer_engine_c.h (default: MOONCAKE_LIB_DIR/../include). bindgen needs \
libclang (Debian: libclang-dev). At run time the library needs Debian's libgoogle-glog0v6 \
libgflags2.2 libjsoncpp25 libibverbs1 libnuma1, and its folder on LD_LIBRARY_PATH unless the \
binary has it as rpath. See docs/transfer.md.";

const HEADER: &str = "transfer_engine_c.h";

fn missing(reason: &str) {
    println!("cargo:missing={} {HOW}", reason.replace('\n', " "));
}

fn main() {
    println!("cargo:rerun-if-env-changed=MOONCAKE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=MOONCAKE_INCLUDE_DIR");
    println!("cargo:rustc-check-cfg=cfg(mooncake_found)");
    let Some(lib_dir) = std::env::var_os("MOONCAKE_LIB_DIR").map(PathBuf::from) else {
        missing("MOONCAKE_LIB_DIR is not set.");
        return;
    };
    if !lib_dir.join("libtransfer_engine.so").exists()
        && !lib_dir.join("libtransfer_engine.a").exists()
    {
        missing(&format!(
            "no libtransfer_engine.so or .a in MOONCAKE_LIB_DIR={}.",
            lib_dir.display()
        ));
        return;
    }
    let include_dir = std::env::var_os("MOONCAKE_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| lib_dir.join("..").join("include"));
    let header = include_dir.join(HEADER);
    if !header.exists() {
        missing(&format!(
            "no {HEADER} in MOONCAKE_INCLUDE_DIR={}.",
            include_dir.display()
        ));
        return;
    }
    println!("cargo:rerun-if-changed={}", header.display());
    let bindings = generate(&header);
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
    let lib_dir = lib_dir.canonicalize().unwrap_or(lib_dir);
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=transfer_engine");
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:rustc-cfg=mooncake_found");
}

fn generate(header: &Path) -> bindgen::Bindings {
    let generated = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header(header.to_string_lossy())
            // Only the engine's own API, not what <stdint.h> declares.
            .allowlist_file(".*transfer_engine_c\\.h")
            // The status and opcode macros compare with C `int` fields.
            .default_macro_constant_type(bindgen::MacroTypeVariation::Signed)
            .layout_tests(false)
            .generate()
    });
    match generated {
        Ok(Ok(bindings)) => bindings,
        Ok(Err(err)) => panic!(
            "\n\nconnex-mooncake-sys: bindgen failed on {}: {err}\n\n{HOW}\n\n",
            header.display()
        ),
        Err(_) => panic!("\n\nconnex-mooncake-sys: bindgen could not run libclang.\n\n{HOW}\n\n"),
    }
}
