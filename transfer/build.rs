//! Turns a missing system library of an enabled backend feature into a build
//! error that says exactly what to install or set (the `-sys` crates build
//! empty without it, since they are workspace members built on every machine).

fn main() {
    if std::env::var_os("CARGO_FEATURE_UCX").is_some() {
        if let Ok(reason) = std::env::var("DEP_UCP_MISSING") {
            panic!("\n\nconnex-transfer feature `ucx`: {reason}\n\n");
        }
    }
    if std::env::var_os("CARGO_FEATURE_MOONCAKE").is_some() {
        if let Ok(reason) = std::env::var("DEP_TRANSFER_ENGINE_MISSING") {
            panic!("\n\nconnex-transfer feature `mooncake`: {reason}\n\n");
        }
        // Mooncake's library is not installed system-wide: this crate's own
        // binaries and tests find it through an rpath (other binaries that
        // link it need LD_LIBRARY_PATH or an rpath of their own).
        if let Ok(dir) = std::env::var("DEP_TRANSFER_ENGINE_LIB_DIR") {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
