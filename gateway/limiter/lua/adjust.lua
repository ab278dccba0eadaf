-- Apply after-the-fact deltas to GCRA buckets, once per (reservation, step).
-- KEYS[1]: the idempotency marker; KEYS[1 + i]: the i-th bucket's hash.
-- ARGV[1]: n; then, per delta, 4 values: field, interval (s/unit), delta (units), ttl (ms).
-- Returns 1 if applied, 0 if this step was already applied.
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', 86400) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[1])
for i = 1, n do
  local b = 2 + (i - 1) * 4
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
