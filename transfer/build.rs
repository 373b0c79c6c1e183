//! Turns a missing system library of an enabled backend feature into a build
//! error that says exactly what to install (the `-sys` crates build empty
//! without it, since they are workspace members built on every machine).

fn main() {
    println!("cargo:rerun-if-env-changed=CONNEX_MOONCAKE_CHECK_ONLY");
    if std::env::var_os("CARGO_FEATURE_UCX").is_some() {
        if let Ok(reason) = std::env::var("DEP_UCP_MISSING") {
            panic!("\n\nconnex-transfer feature `ucx`: {reason}\n\n");
        }
    }
    if std::env::var_os("CARGO_FEATURE_MOONCAKE").is_some() {
        let check_only = std::env::var_os("CONNEX_MOONCAKE_CHECK_ONLY").is_some_and(|v| v == "1");
        if let (Ok(reason), false) = (std::env::var("DEP_TRANSFER_ENGINE_MISSING"), check_only) {
            panic!("\n\nconnex-transfer feature `mooncake`: {reason}\n\n");
        }
    }
}
