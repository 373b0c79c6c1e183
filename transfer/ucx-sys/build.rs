//! Finds the system UCX with pkg-config and generates its bindings with
//! bindgen. This crate is a workspace member, so it must build on machines
//! without UCX too: then it binds nothing and tells its dependent (through
//! `links` metadata, `DEP_UCP_MISSING`) what to install; connex-transfer's
//! build script turns that into the error when its `ucx` feature is on.

use std::path::PathBuf;

const INSTALL: &str = "On Debian/Ubuntu: apt-get install libucx-dev libclang-dev pkg-config \
     (or set PKG_CONFIG_PATH to a UCX >= 1.10 install that has ucx.pc, and LIBCLANG_PATH to libclang)";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rustc-check-cfg=cfg(ucx_found)");
    let ucx = match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("ucx")
    {
        Ok(ucx) => ucx,
        Err(err) => {
            let reason = format!(
                "the UCX library (ucp, >= 1.10) was not found by pkg-config: {err}. {INSTALL}"
            );
            println!("cargo:missing={}", reason.replace('\n', " "));
            return;
        }
    };
    let includes: Vec<String> = ucx
        .include_paths
        .iter()
        .map(|p| format!("-I{}", p.display()))
        .collect();
    let generated = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header("wrapper.h")
            .clang_args(&includes)
            .allowlist_function("ucp_.*|ucs_status_string")
            .allowlist_type("ucp_.*|ucs_status_t|ucs_thread_mode_t")
            .allowlist_var("UCP_.*|UCS_.*")
            .prepend_enum_name(false)
            .layout_tests(false)
            .generate()
    });
    let bindings = match generated {
        Ok(Ok(bindings)) => bindings,
        Ok(Err(err)) => {
            panic!("\n\nconnex-ucx-sys: bindgen failed on the UCX headers: {err}\n\n{INSTALL}\n\n")
        }
        Err(_) => panic!("\n\nconnex-ucx-sys: bindgen could not run libclang.\n\n{INSTALL}\n\n"),
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
    println!("cargo:rustc-cfg=ucx_found");
}
