//! Worker discovery by DNS (`--worker-dns`): a [`DnsSource`] names a DNS name whose answer is
//! a set of workers, re-read every `dns_refresh_secs`; [`Reconciler`] turns each answer into
//! the workers to add and to remove. No sockets here: the lookups are behind [`Resolve`] and
//! the fleet behind [`Fleet`] (`kvroute-io` implements both), so [`refresh`] is tested with
//! fakes.
//!
//! Two forms of source (`--worker-dns`, repeatable; TOML `worker_dns = [..]`):
//!
//! | spec | lookup | each worker |
//! |---|---|---|
//! | `NAME:PORT` | A and AAAA of `NAME` | `http://ADDR:PORT` per address |
//! | `srv:NAME` (e.g. `srv:_http._tcp.vllm.default.svc.cluster.local`) | SRV of `NAME`, then A/AAAA of each target | `http://ADDR:PORT`, the port of the record |
//!
//! Options follow as `;key=value`, as in a worker spec ([`crate::config::parse_worker_spec`]):
//! `events_port=P` and `replay_port=P` (each discovered worker's KV-event PUB and replay
//! ROUTER endpoints are `tcp://ADDR:P`, the same address as its HTTP port: one engine per
//! pod), `dp=N`, `model=NAME` (repeatable) and `api_key_env=VAR`, given to every worker of
//! the source.
//!
//! # Invariants
//! 1. Only an answer with at least one address changes the wanted set: a failed lookup
//!    (NXDOMAIN, no records, timeout, a nameserver error) or an empty answer keeps the last
//!    good set, so a DNS outage never empties the fleet. (A service scaled to zero therefore
//!    keeps its last workers, unhealthy by their health checks, until an answer names others.)
//! 2. The wanted set is the last good answer, deduplicated and sorted, cut to the `cap`
//!    lowest addresses ([`crate::config::defaults::DNS_MAX_ADDRESSES`]); a cut is reported.
//! 3. After [`refresh`], every wanted address whose add succeeded is a member (a worker of
//!    the fleet) and no member is unwanted: members that left the answer are removed, members
//!    still in it are untouched (same worker id, its load, breaker and caches kept).
//! 4. A failed add (the fleet refused it, e.g. its URL is still present while a removal
//!    drains) is retried at the next refresh; a member the fleet no longer has (removed by
//!    the admin API) is forgotten and added again while DNS still names it.
//! 5. An address that leaves and comes back is added anew: a new worker id, clean state
//!    (ids are slots that are never reused, [`crate::workers::Workers`]).

use crate::CoreError;
use crate::config::{WorkerSpec, parse_worker_spec};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// What one source asks DNS.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DnsQuery {
    /// A and AAAA records of `name`; every address is a worker on `port`.
    Host {
        /// The DNS name (or an IP literal), without brackets.
        name: String,
        /// The workers' HTTP port, 1–65535.
        port: u16,
    },
    /// SRV records of `name`; every target's addresses are workers on the record's port.
    Srv {
        /// The SRV name, e.g. `_http._tcp.vllm.default.svc.cluster.local`.
        name: String,
    },
}

/// One `--worker-dns` source, parsed by [`parse_dns_source`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsSource {
    /// The query part of the spec as given (`NAME:PORT` or `srv:NAME`, options cut): the
    /// `source` label of the discovery metrics and of the log lines.
    pub label: String,
    /// What to look up.
    pub query: DnsQuery,
    /// Each worker's KV-event PUB port (`;events_port=P`): endpoint `tcp://ADDR:P`.
    pub events_port: Option<u16>,
    /// Each worker's replay ROUTER port (`;replay_port=P`, needs `events_port`).
    pub replay_port: Option<u16>,
    /// Data-parallel ranks of each worker (`;dp=N`, 1–1024; 1 by default).
    pub dp: u32,
    /// Models each worker serves (`;model=NAME`, repeatable); empty = read from its
    /// `/v1/models`.
    pub models: Vec<String>,
    /// Environment variable of the workers' API key (`;api_key_env=VAR`).
    pub api_key_env: Option<String>,
}

impl DnsSource {
    /// The worker spec of the worker at `addr` (an address from this source's answer):
    /// `http://ADDR:PORT` (IPv6 in brackets) with this source's options, KV-event endpoints
    /// on the same address.
    ///
    /// # Errors
    /// [`CoreError::BadWorkerUrl`] cannot happen for a source [`parse_dns_source`] accepted;
    /// it is passed on rather than hidden.
    pub fn worker_spec(&self, addr: SocketAddr) -> Result<WorkerSpec, CoreError> {
        let mut spec = format!("http://{addr}");
        let at = |port: u16| SocketAddr::new(addr.ip(), port);
        if let Some(p) = self.events_port {
            spec.push_str(&format!(";events=tcp://{}", at(p)));
        }
        if let Some(p) = self.replay_port {
            spec.push_str(&format!(";replay=tcp://{}", at(p)));
        }
        if self.dp != 1 {
            spec.push_str(&format!(";dp={}", self.dp));
        }
        for m in &self.models {
            spec.push_str(&format!(";model={m}"));
        }
        if let Some(v) = &self.api_key_env {
            spec.push_str(&format!(";api_key_env={v}"));
        }
        parse_worker_spec(&spec)
    }
}

/// True for a DNS name kvroute looks up: 1–253 chars of ASCII letters, digits, `-`, `_`
/// (SRV labels) and `.`, no empty label (a single trailing `.`, fully qualified, is allowed).
fn is_dns_name(name: &str) -> bool {
    let n = name.strip_suffix('.').unwrap_or(name);
    !n.is_empty()
        && name.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Parses a `--worker-dns` spec: `NAME:PORT` or `srv:NAME`, then `;key=value` options
/// (`events_port`, `replay_port`, `dp`, `model`, `api_key_env`; see the module table).
/// `NAME` may be an IP literal (`[v6]` in brackets).
///
/// # Errors
/// [`CoreError::BadDnsSource`] naming the spec and the problem: no port, a port that is not
/// 1–65535, a name that is not a DNS name, an unknown or malformed option, `replay_port`
/// without `events_port`.
pub fn parse_dns_source(spec: &str) -> Result<DnsSource, CoreError> {
    let bad = |problem| CoreError::BadDnsSource {
        spec: spec.to_string(),
        problem,
    };
    let mut parts = spec.split(';');
    let head = parts.next().unwrap_or("").trim();
    let srv = head
        .strip_prefix("srv:")
        .filter(|rest| rest.parse::<u16>().is_err());
    let query = if let Some(name) = srv {
        if !is_dns_name(name) {
            return Err(bad(
                "srv: must be followed by a DNS name (srv:_http._tcp.NAME)",
            ));
        }
        DnsQuery::Srv {
            name: name.to_string(),
        }
    } else {
        let (host, port) = head
            .rsplit_once(':')
            .ok_or_else(|| bad("expected NAME:PORT or srv:NAME"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| bad("port must be a number 1-65535"))?;
        let name = match host.strip_prefix('[') {
            Some(v6) => v6
                .strip_suffix(']')
                .filter(|v| v.parse::<std::net::Ipv6Addr>().is_ok())
                .ok_or_else(|| bad("a bracketed host must be an IPv6 address"))?,
            None if host.parse::<std::net::Ipv4Addr>().is_ok() || is_dns_name(host) => host,
            None => return Err(bad("NAME must be a DNS name or an IP address")),
        };
        DnsQuery::Host {
            name: name.to_string(),
            port,
        }
    };
    let mut out = DnsSource {
        label: head.to_string(),
        query,
        events_port: None,
        replay_port: None,
        dp: 1,
        models: Vec::new(),
        api_key_env: None,
    };
    let port = |v: &str| {
        v.trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| bad("events_port/replay_port must be a number 1-65535"))
    };
    for opt in parts.map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = opt
            .split_once('=')
            .ok_or_else(|| bad("options are ;key=value"))?;
        match k.trim() {
            "events_port" => out.events_port = Some(port(v)?),
            "replay_port" => out.replay_port = Some(port(v)?),
            "dp" | "model" | "api_key_env" => crate::config::common_option(
                k.trim(),
                v,
                &mut out.dp,
                &mut out.models,
                &mut out.api_key_env,
            )
            .map_err(bad)?,
            "events" | "replay" => {
                return Err(bad(
                    "discovered workers take events_port=P / replay_port=P (their own address)",
                ));
            }
            _ => {
                return Err(bad(
                    "unknown option (expected events_port, replay_port, dp, model, api_key_env)",
                ));
            }
        }
    }
    if out.replay_port.is_some() && out.events_port.is_none() {
        return Err(bad("replay_port needs events_port"));
    }
    Ok(out)
}

/// Why a lookup gave no usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupError {
    /// The name does not exist or has no records of the type (NXDOMAIN, NODATA).
    NotFound(String),
    /// No answer in time.
    Timeout(String),
    /// Any other failure (nameserver error, refused, unreachable), as the resolver says it.
    Other(String),
}

impl std::fmt::Display for LookupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LookupError::NotFound(m) => write!(f, "not found: {m}"),
            LookupError::Timeout(m) => write!(f, "timed out: {m}"),
            LookupError::Other(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for LookupError {}

/// Looks a [`DnsQuery`] up: every worker address of the answer (duplicates and any order
/// allowed). `kvroute-io` has the real one; tests use fakes.
pub trait Resolve {
    /// The addresses `query` names now.
    ///
    /// # Errors
    /// [`LookupError`] when DNS gives no answer.
    fn resolve(&mut self, query: &DnsQuery) -> Result<Vec<SocketAddr>, LookupError>;
}

/// The fleet discovery changes. `kvroute-io` implements it with the admin API's add and
/// removal (health check, models, KV-event subscription; drain, wait, purge).
pub trait Fleet {
    /// Adds the worker of `spec`; returns its id.
    ///
    /// # Errors
    /// Why it was refused (retried at the next refresh).
    fn add(&mut self, spec: &WorkerSpec) -> Result<usize, String>;
    /// Removes worker `id` without cutting its requests in flight (drain first).
    fn remove(&mut self, id: usize);
    /// True while worker `id` is in the fleet.
    fn present(&self, id: usize) -> bool;
}

/// What one answer asks for ([`Reconciler::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Wanted addresses that are not members yet, ascending.
    pub add: Vec<SocketAddr>,
    /// Members no longer wanted, with their worker ids, ascending by address.
    pub remove: Vec<(SocketAddr, usize)>,
    /// How the lookup went.
    pub outcome: Outcome,
}

/// How one lookup went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// An answer with `addresses` distinct addresses, of which `dropped` beyond the cap.
    Answered {
        /// Distinct addresses in the answer.
        addresses: usize,
        /// Addresses dropped by the cap (0: none).
        dropped: usize,
    },
    /// No usable answer: the wanted set is unchanged (invariant 1).
    Failed(LookupError),
}

/// One source's state: the wanted set (its last good answer, capped) and the members (the
/// workers it added). See the module's invariants.
#[derive(Debug, Clone, Default)]
pub struct Reconciler {
    cap: usize,
    wanted: BTreeSet<SocketAddr>,
    members: BTreeMap<SocketAddr, usize>,
}

impl Reconciler {
    /// A source with nothing wanted yet, keeping at most `cap` (≥ 1) addresses per answer.
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            ..Self::default()
        }
    }

    /// Takes one lookup's result: an answer with addresses replaces the wanted set (deduped,
    /// sorted, the `cap` lowest kept), anything else keeps it. Returns what to add and remove
    /// to make the members the wanted set. Changes no member: report what was done with
    /// [`Reconciler::added`] and [`Reconciler::removed`].
    pub fn plan(&mut self, answer: Result<Vec<SocketAddr>, LookupError>) -> Plan {
        let outcome = match answer {
            Ok(addrs) if !addrs.is_empty() => {
                let all: BTreeSet<SocketAddr> = addrs.into_iter().collect();
                let addresses = all.len();
                self.wanted = all.into_iter().take(self.cap).collect();
                Outcome::Answered {
                    addresses,
                    dropped: addresses - self.wanted.len(),
                }
            }
            Ok(_) => Outcome::Failed(LookupError::NotFound("empty answer".into())),
            Err(e) => Outcome::Failed(e),
        };
        let add = self
            .wanted
            .iter()
            .filter(|a| !self.members.contains_key(a))
            .copied()
            .collect();
        let remove = self
            .members
            .iter()
            .filter(|(a, _)| !self.wanted.contains(a))
            .map(|(&a, &id)| (a, id))
            .collect();
        Plan {
            add,
            remove,
            outcome,
        }
    }

    /// Records that `addr` became worker `id`.
    pub fn added(&mut self, addr: SocketAddr, id: usize) {
        self.members.insert(addr, id);
    }

    /// Records that the worker of `addr` was removed (or is being drained away).
    pub fn removed(&mut self, addr: SocketAddr) {
        self.members.remove(&addr);
    }

    /// Forgets members for which `present` is false (removed by someone else: invariant 4).
    pub fn retain_present(&mut self, present: impl Fn(usize) -> bool) {
        self.members.retain(|_, id| present(*id));
    }

    /// The wanted set: the last good answer, capped.
    pub fn wanted(&self) -> &BTreeSet<SocketAddr> {
        &self.wanted
    }

    /// The members: address → worker id.
    pub fn members(&self) -> &BTreeMap<SocketAddr, usize> {
        &self.members
    }
}

/// What one [`refresh`] did, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refreshed {
    /// How the lookup went.
    pub outcome: Outcome,
    /// `(address, worker id)` added.
    pub added: Vec<(SocketAddr, usize)>,
    /// `(address, worker id)` removed.
    pub removed: Vec<(SocketAddr, usize)>,
    /// `(address, why)` of adds the fleet refused (retried next time).
    pub refused: Vec<(SocketAddr, String)>,
}

/// One refresh of `source`: looks it up with `resolver`, plans with `state`, removes the
/// members that left, then adds the new addresses through `fleet` (invariants 1–5).
pub fn refresh(
    source: &DnsSource,
    state: &mut Reconciler,
    resolver: &mut dyn Resolve,
    fleet: &mut dyn Fleet,
) -> Refreshed {
    state.retain_present(|id| fleet.present(id));
    let plan = state.plan(resolver.resolve(&source.query));
    let mut out = Refreshed {
        outcome: plan.outcome,
        added: Vec::new(),
        removed: Vec::new(),
        refused: Vec::new(),
    };
    for (addr, id) in plan.remove {
        fleet.remove(id);
        state.removed(addr);
        out.removed.push((addr, id));
    }
    for addr in plan.add {
        match source
            .worker_spec(addr)
            .map_err(|e| e.to_string())
            .and_then(|spec| fleet.add(&spec))
        {
            Ok(id) => {
                state.added(addr, id);
                out.added.push((addr, id));
            }
            Err(why) => out.refused.push((addr, why)),
        }
    }
    out
}

#[cfg(test)]
mod tests;
