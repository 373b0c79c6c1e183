//! TCP plumbing shared by the holder, the readers and the router: listeners
//! with a deep accept backlog, pools of idle keep-alive connections, and a
//! bound on how many of something run at once per peer address.

mod idle;
mod limit;

pub use idle::IdlePool;
pub use limit::{Admitted, KeyedLimit};

use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpSocket};

/// Accept backlog of a listener (tokio's default is 1,024; the kernel caps it
/// at `net.core.somaxconn`): thousands of connections opened at once (streams
/// at a router, pulls at a holder) wait here to be accepted instead of being
/// reset or timing out (`bench/run scale`).
pub const ACCEPT_BACKLOG: u32 = 16_384;

/// A listener on `addr` with [`ACCEPT_BACKLOG`].
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }?;
    // As tokio's `TcpListener::bind`: a restarted process rebinds its port at
    // once, whatever connections of its last run linger in TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}
