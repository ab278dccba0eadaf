-- Apply after-the-fact deltas to GCRA buckets, once per (reservation, step).
-- KEYS[1]: the reservation's idempotency marker (a hash, one field per step applied);
-- KEYS[1 + i]: the i-th bucket's hash.
-- ARGV[1]: n; ARGV[2]: the step; ARGV[3]: the marker's life (ms, the reservation's);
-- then, per delta, 4 values: field, interval (s/unit), delta (units), ttl (ms).
-- Returns 1 if applied, 0 if this step was already applied.
if redis.call('HSETNX', KEYS[1], ARGV[2], '1') == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[1])
for i = 1, n do
  local b = 4 + (i - 1) * 4
  local key = KEYS[1 + i]
  local tat = tonumber(redis.call('HGET', key, ARGV[b]) or '0')
  local delta = tonumber(ARGV[b + 2])
  local new_tat = math.max(tat, now) + delta * tonumber(ARGV[b + 1])
  if delta < 0 and new_tat < now then new_tat = now end
  redis.call('HSET', key, ARGV[b], string.format('%.6f', new_tat))
  local ttl = tonumber(ARGV[b + 3])
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 1
