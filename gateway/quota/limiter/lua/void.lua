-- Void a reservation whose answer was lost (a timeout, a dropped connection): exactly once,
-- whether the reservation ran before this or never did (then it never will: reserve.lua
-- refuses a voided reservation).
-- KEYS[1]: the reservation's marker; KEYS[1 + i]: the i-th bucket's hash.
-- ARGV[1]: n; ARGV[2]: the marker's life (ms); then, per charge, 4 values: field,
-- interval (s/unit), cost (units), ttl (ms); then k: the last k charges were optional (given
-- back only if the reservation took them, 'o').
-- Returns 1 if the reservation had run and was given back, 2 if it had not run, 0 if it was
-- already voided.
if redis.call('HSETNX', KEYS[1], 'void', '1') == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if not redis.call('HGET', KEYS[1], 'r') then return 2 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[1])
if not redis.call('HGET', KEYS[1], 'o') then n = n - tonumber(ARGV[3 + n * 4] or '0') end
for i = 1, n do
  local b = 3 + (i - 1) * 4
  local key = KEYS[1 + i]
  local tat = tonumber(redis.call('HGET', key, ARGV[b]) or '0')
  local new_tat = tat - tonumber(ARGV[b + 2]) * tonumber(ARGV[b + 1])
  if new_tat < now then new_tat = now end
  redis.call('HSET', key, ARGV[b], string.format('%.6f', new_tat))
  local ttl = tonumber(ARGV[b + 3])
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 1
