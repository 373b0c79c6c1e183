//! The Lua scripts the store runs: each write of a background response and
//! each lease change touches several keys at once, and only while the lease
//! is the caller's (one script call: no other replica's write in between).

use super::settings::RedisSettings;

/// Appends a background response's events past those already there (so that
/// a retried append writes each event once), sets its state and checkpoint
/// (and its origin, once; and its stored response, as it ends), and renews
/// the writer's lease on it; all at once, and only while the lease is the
/// writer's (another replica that took the generation over has it: -1, and
/// nothing is written; none has it, as after it ran out while the store was
/// unreachable: the writer takes it again, unless the response is done,
/// ended by a replica that took it over). Done: the lease and the
/// response's place among the running ones go. Returns whether a cancel was
/// asked (1) or not (0): the writer needs no call of its own to know.
/// K (the response's keys, named here from the prefix and the id): state
/// hash, events stream, checkpoint, lease, running set, cancel, origin,
/// stored. A write goes ten times a second: it sends its changes, not what
/// is the same every time (key names; the key prefix, TTL and lease, which
/// are the script's own, `append_script`; arguments it has nothing for).
/// ARGV: response id, lease token, checkpoint ('' keeps the last; '=' then
/// the whole one, '+' then a patch of the last: -2, and nothing written,
/// when there is none to patch), then what follows: done (0/1) and a letter
/// for each argument that follows, in this order: `t` tenant, `r` response
/// ('@' then a length: the stored response's, the bytes after
/// `{"response":` in it), `o` origin, `s` stored response; then sequence
/// number and event, pairs.
pub(super) const APPEND: &str = r"
local base = PREFIX .. '{' .. ARGV[1] .. '}:'
local K = {base .. 'bg', base .. 'events', base .. 'checkpoint', base .. 'lease',
           PREFIX .. 'running', base .. 'cancel', base .. 'origin', base .. 'stored'}
local done = string.sub(ARGV[4], 1, 1)
local given = {}
local i = 5
for what in string.gmatch(string.sub(ARGV[4], 2), '.') do
  given[what] = ARGV[i]
  i = i + 1
end
local holder = redis.call('GET', K[4])
if holder and holder ~= ARGV[2] then return -1 end
if not holder and redis.call('HGET', K[1], 'done') == '1' then return -1 end
local patching = string.sub(ARGV[3], 1, 1) == '+'
if patching and redis.call('TYPE', K[3])['ok'] ~= 'list' then return -2 end
local last = 0
local top = redis.call('XREVRANGE', K[2], '+', '-', 'COUNT', 1)
if #top > 0 then last = tonumber(string.match(top[1][1], '%-(%d+)$')) end
for j = i, #ARGV, 2 do
  local n = tonumber(ARGV[j]) + 1
  if n > last then
    redis.call('XADD', K[2], '0-' .. n, 'e', ARGV[j + 1])
    last = n
  end
end
if given.s then redis.call('SET', K[8], given.s, 'EX', TTL) end
if given.t then redis.call('HSET', K[1], 'tenant', given.t) end
redis.call('HSET', K[1], 'done', done)
local response = given.r
if response and string.sub(response, 1, 1) == '@' then
  response = string.sub(given.s or '', 13, 12 + tonumber(string.sub(response, 2)))
end
if response then redis.call('HSET', K[1], 'response', response) end
redis.call('EXPIRE', K[1], TTL)
if last > 0 then redis.call('EXPIRE', K[2], TTL) end
if ARGV[3] ~= '' then
  if not patching then redis.call('DEL', K[3]) end
  redis.call('RPUSH', K[3], string.sub(ARGV[3], 2))
  redis.call('EXPIRE', K[3], TTL)
end
if given.o then redis.call('SET', K[7], given.o, 'EX', TTL) end
if done == '1' then
  redis.call('DEL', K[4])
  redis.call('ZREM', K[5], ARGV[1])
else
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', K[4], ARGV[2], 'PX', LEASE_MS)
  redis.call('ZADD', K[5], now + LEASE_MS, ARGV[1])
end
return redis.call('EXISTS', K[6])
";

/// `APPEND` for a store of these settings: its key prefix (each byte
/// escaped, whatever it is), TTL and lease as constants of its own.
fn append_script(settings: &RedisSettings) -> String {
    let prefix: String = settings.prefix.bytes().map(|b| format!("\\{b}")).collect();
    let lease_ms = u64::try_from(settings.lease.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    format!(
        "local PREFIX = '{prefix}'\nlocal TTL = {}\nlocal LEASE_MS = {lease_ms}\n{APPEND}",
        settings.ttl.as_secs().max(1)
    )
}

/// Claims running responses whose lease expired (their replica is gone): for
/// each, a lease of the claimer's, set only where none is (one winner); never
/// one of the claimer's own (its writer goes on when the store is back).
/// An id that cannot be a response's (`valid_response_id`: forged in the
/// running set) names no key: it is dropped from the set, never claimed.
/// KEYS: running set. ARGV: token, lease ms, key prefix, most to claim, then
/// the ids to leave alone. Returns the ids won.
pub(super) const CLAIM: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local own = {}
for i = 5, #ARGV do own[ARGV[i]] = true end
local most = tonumber(ARGV[4])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, most + #ARGV - 4)
local won = {}
for _, id in ipairs(due) do
  if #won >= most then break end
  local lease = ARGV[3] .. '{' .. id .. '}:lease'
  if #id > 128 or not string.match(id, '^[%w_%-]+$') then
    redis.call('ZREM', KEYS[1], id)
  elseif not own[id] and redis.call('SET', lease, ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    table.insert(won, id)
  end
end
return won
";

/// Lets a lease go (its holder stops): the response is due at once.
/// KEYS: lease, running set. ARGV: token, response id.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZADD', KEYS[2], 0, ARGV[2])
end
return 1
";

/// Renews a lease still held by its token (a replica taking a response over,
/// before it starts the generation): 1, or 0 when another holds it or none.
/// KEYS: lease, running set. ARGV: token, lease ms, response id.
pub(super) const RENEW_LEASE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
";

/// Reads a checkpoint as written (a list: whole, then patches; a string:
/// whole, as a replica before patches wrote it). KEYS: checkpoint.
pub(super) const READ_CHECKPOINT: &str = r"
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'list' then return redis.call('LRANGE', KEYS[1], 0, -1) end
if kind == 'string' then return {redis.call('GET', KEYS[1])} end
return {}
";

/// Renews the TTL of every key of running responses (`from`..`to` by rank
/// in the running set): a response lives as long as it runs, whatever its
/// keys' last write (`:origin` is written once, at the start).
/// KEYS: running set. ARGV: key prefix, ttl seconds, from, to (ranks).
/// Returns how many responses were renewed.
pub(super) const RENEW: &str = r"
local ids = redis.call('ZRANGE', KEYS[1], ARGV[3], ARGV[4])
for _, id in ipairs(ids) do
  for _, what in ipairs({'bg', 'events', 'checkpoint', 'origin', 'cancel'}) do
    redis.call('EXPIRE', ARGV[1] .. '{' .. id .. '}:' .. what, ARGV[2])
  end
end
return #ids
";

/// The scripts, made once per store (their hashes computed once).
pub(super) struct Scripts {
    pub(super) append: redis::Script,
    pub(super) claim: redis::Script,
    pub(super) release: redis::Script,
    pub(super) renew_lease: redis::Script,
    pub(super) read_checkpoint: redis::Script,
    pub(super) renew: redis::Script,
}

impl Scripts {
    pub(super) fn new(settings: &RedisSettings) -> Self {
        Self {
            append: redis::Script::new(&append_script(settings)),
            claim: redis::Script::new(CLAIM),
            release: redis::Script::new(RELEASE),
            renew_lease: redis::Script::new(RENEW_LEASE),
            read_checkpoint: redis::Script::new(READ_CHECKPOINT),
            renew: redis::Script::new(RENEW),
        }
    }

    /// Those loaded into Redis as a connection opens (`connection.rs`).
    pub(super) fn preloaded(&self) -> [&redis::Script; 5] {
        [
            &self.append,
            &self.claim,
            &self.release,
            &self.read_checkpoint,
            &self.renew,
        ]
    }
}
