//! Mooncake Transfer Engine's C API, declared by hand from its documented
//! interface (`transfer_engine_c.h` upstream: the header is not shipped by any
//! package this project can install, so bindgen has nothing to read here).
//! The id types are `#define`s upstream: segment ids are `int32_t`, batch ids
//! `uint64_t`, and `INVALID_BATCH` is `UINT64_MAX`.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

pub type transfer_engine_t = *mut c_void;
pub type transport_t = *mut c_void;
pub type segment_id_t = i32;
pub type batch_id_t = u64;

pub const INVALID_BATCH: batch_id_t = u64::MAX;
pub const OPCODE_READ: c_int = 0;
pub const OPCODE_WRITE: c_int = 1;

pub const STATUS_WAITING: c_int = 0;
pub const STATUS_PENDING: c_int = 1;
pub const STATUS_INVALID: c_int = 2;
pub const STATUS_CANCELED: c_int = 3;
pub const STATUS_COMPLETED: c_int = 4;
pub const STATUS_TIMEOUT: c_int = 5;
pub const STATUS_FAILED: c_int = 6;

/// One transfer of a batch; `target_offset` is the remote virtual address.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct transfer_request {
    pub opcode: c_int,
    pub source: *mut c_void,
    pub target_id: segment_id_t,
    pub file_id: u32,
    pub target_offset: u64,
    pub length: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct transfer_status {
    pub status: c_int,
    pub transferred_bytes: u64,
}

extern "C" {
    pub fn createTransferEngine(
        metadata_conn_string: *const c_char,
        local_server_name: *const c_char,
        ip_or_host_name: *const c_char,
        rpc_port: u64,
        auto_discover: c_int,
    ) -> transfer_engine_t;
    pub fn getLocalIpAndPort(
        engine: transfer_engine_t,
        buf_out: *mut c_char,
        buf_len: usize,
    ) -> c_int;
    pub fn installTransport(
        engine: transfer_engine_t,
        proto: *const c_char,
        args: *mut *mut c_void,
    ) -> transport_t;
    pub fn openSegment(engine: transfer_engine_t, segment_name: *const c_char) -> segment_id_t;
    pub fn closeSegment(engine: transfer_engine_t, segment_id: segment_id_t) -> c_int;
    pub fn destroyTransferEngine(engine: transfer_engine_t);
    pub fn registerLocalMemory(
        engine: transfer_engine_t,
        addr: *mut c_void,
        length: usize,
        location: *const c_char,
        remote_accessible: c_int,
    ) -> c_int;
    pub fn unregisterLocalMemory(engine: transfer_engine_t, addr: *mut c_void) -> c_int;
    pub fn allocateBatchID(engine: transfer_engine_t, batch_size: usize) -> batch_id_t;
    pub fn submitTransfer(
        engine: transfer_engine_t,
        batch_id: batch_id_t,
        entries: *mut transfer_request,
        count: usize,
    ) -> c_int;
    pub fn getTransferStatus(
        engine: transfer_engine_t,
        batch_id: batch_id_t,
        task_id: usize,
        status: *mut transfer_status,
    ) -> c_int;
    pub fn freeBatchID(engine: transfer_engine_t, batch_id: batch_id_t) -> c_int;
}
