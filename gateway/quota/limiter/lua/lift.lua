-- Bring buckets of one scope to at least the units a ledger says were used in them, at Redis
-- server time (a bucket already above is left alone: lifting twice changes nothing).
-- KEYS[1]: the scope's hash. ARGV: per bucket 4 values: field (limit kind), interval
-- (s/unit), used (units), ttl (ms). Returns how many buckets were raised.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local raised = 0
for i = 1, #ARGV, 4 do
  local tat = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  local interval = tonumber(ARGV[i + 1])
  local floor = now + tonumber(ARGV[i + 2]) * interval
  if floor - tat > 1e-6 * interval then  -- bucket.LIFT_SLACK_UNITS: a lift to the same count
    -- changes nothing however much time passed (a spend cap refills a unit in 1e13 s)
    redis.call('HSET', KEYS[1], ARGV[i], string.format('%.6f', floor))
    raised = raised + 1
  end
  local ttl = tonumber(ARGV[i + 3])
  if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
end
return raised
