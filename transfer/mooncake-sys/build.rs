//! Links Mooncake Transfer Engine's C library from the folder the user names.
//!
//! Neither PyPI nor Debian ships the library with its C API (the wheel
//! `mooncake-transfer-engine-non-cuda` has only a Python extension), so it must
//! come from a Mooncake build of the user's own. This crate is a workspace
//! member, so it must build without the library too: then it links nothing
//! and tells its dependent why (`links` metadata, `DEP_TRANSFER_ENGINE_MISSING`);
//! connex-transfer's build script turns that into the error when its
//! `mooncake` feature is on (unless `CONNEX_MOONCAKE_CHECK_ONLY=1`).

const MISSING: &str = "set MOONCAKE_LIB_DIR to the folder that holds \
libtransfer_engine.so (Mooncake's transfer engine C API, transfer_engine_c.h), built from \
Mooncake's source (github kvcache-ai/Mooncake, mooncake-transfer-engine; the PyPI wheel has no \
C API). At run time the same folder must be on LD_LIBRARY_PATH, and the TCP transport needs \
Debian's libibverbs1. For a compile check only, set CONNEX_MOONCAKE_CHECK_ONLY=1.";

fn main() {
    println!("cargo:rerun-if-env-changed=MOONCAKE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=CONNEX_MOONCAKE_CHECK_ONLY");
    let Some(dir) = std::env::var_os("MOONCAKE_LIB_DIR") else {
        println!("cargo:missing={MISSING}");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    if !dir.join("libtransfer_engine.so").exists() && !dir.join("libtransfer_engine.a").exists() {
        println!(
            "cargo:missing=no libtransfer_engine.so or .a in MOONCAKE_LIB_DIR={}. {MISSING}",
            dir.display()
        );
        return;
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=transfer_engine");
}
