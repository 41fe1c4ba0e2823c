//! [`Conn`]: a monoio stream with a read buffer, for both sides of the proxy; generic over
//! its [`Transport`] (TCP today; TLS wraps a TCP stream the same way).
//!
//! monoio hands buffers to the kernel (io_uring owns them while a read is in flight), so
//! reads append into the spare capacity of an owned `Vec` and writes pass the `Vec` by value
//! and get it back.

use monoio::buf::{IoBuf, IoBufMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use std::io;

/// Smallest free space offered to one read, in bytes.
const MIN_READ_SPACE: usize = kvroute_core::config::defaults::MIN_READ_BYTES;

/// A byte stream a [`Conn`] can run on: readable, writable, and able to tell when its peer
/// has gone while nothing is being read (bug-cases.md B41).
pub trait Transport: AsyncReadRent + AsyncWriteRent {
    /// Resolves once the peer has gone (EOF or reset); never while it is there, even when it
    /// sends data (which stays unread for the next exchange).
    fn peer_gone(&self) -> impl std::future::Future<Output = ()>;
}

impl Transport for TcpStream {
    async fn peer_gone(&self) {
        peer_gone(self).await
    }
}

/// A connection plus the bytes read from it but not consumed yet.
///
/// # Invariants
/// 1. `buf[..]` holds exactly the unconsumed bytes, in arrival order.
pub struct Conn<S = TcpStream> {
    /// The transport.
    pub stream: S,
    buf: Vec<u8>,
}

impl Conn<TcpStream> {
    /// Wraps `stream` with an empty buffer; sets `TCP_NODELAY` (SSE chunks are small and
    /// latency-bound).
    pub fn new(stream: TcpStream) -> Self {
        let _ = stream.set_nodelay(true);
        Self::over(stream)
    }
}

impl<S: AsyncReadRent + AsyncWriteRent> Conn<S> {
    /// Wraps any transport with an empty buffer.
    pub fn over(stream: S) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(MIN_READ_SPACE),
        }
    }

    /// Unconsumed bytes.
    pub fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Drops the first `n` buffered bytes.
    pub fn consume(&mut self, n: usize) {
        self.buf.drain(..n);
    }

    /// Takes all buffered bytes, leaving the buffer empty (unallocated: the next
    /// [`Conn::fill`] allocates, unless [`Conn::restore_buffer`] gives one back first).
    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    /// Gives `buf` back as the read buffer, emptied, when nothing is buffered (a relay hands
    /// back the buffer it took with [`Conn::take_buffered`], so a reused connection does not
    /// allocate a read buffer per response). Bytes already buffered win: `buf` is dropped.
    pub fn restore_buffer(&mut self, mut buf: Vec<u8>) {
        if self.buf.is_empty() && buf.capacity() > self.buf.capacity() {
            buf.clear();
            self.buf = buf;
        }
    }

    /// Reads once, appending to the buffer. Returns the bytes read; 0 means the peer closed.
    ///
    /// # Errors
    /// The socket's error.
    pub async fn fill(&mut self) -> io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < MIN_READ_SPACE / 2 {
            self.buf.reserve(MIN_READ_SPACE);
        }
        let buf = std::mem::take(&mut self.buf);
        let (len, cap) = (buf.len(), buf.capacity());
        let (res, slice) = self.stream.read(buf.slice_mut(len..cap)).await;
        self.buf = slice.into_inner();
        res
    }

    /// Writes all of `data`, returning the buffer for reuse.
    ///
    /// # Errors
    /// The socket's error (e.g. the peer reset the connection).
    pub async fn write_all<B: IoBuf + 'static>(&mut self, data: B) -> (io::Result<()>, B) {
        let (res, data) = self.stream.write_all(data).await;
        (res.map(|_| ()), data)
    }
}

/// Resolves once the peer of `stream` has gone (EOF or reset), so a request can be cancelled
/// while kvroute waits on the worker (bug-cases.md B41). Never resolves once the peer sends
/// data (a pipelined request): those bytes stay unread for the next exchange.
pub async fn peer_gone(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    loop {
        if stream.readable(false).await.is_err() {
            return;
        }
        let mut byte = 0u8;
        // Safety: `byte` is a valid 1-byte buffer for the duration of the call; MSG_PEEK
        // leaves any data in the socket.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return,
            n if n > 0 => return std::future::pending().await,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::WouldBlock
                    && err.kind() != io::ErrorKind::Interrupted
                {
                    return;
                }
            }
        }
    }
}
