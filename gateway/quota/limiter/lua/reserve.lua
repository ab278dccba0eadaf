-- Reserve on several GCRA buckets at once, all or nothing, at Redis server time.
-- KEYS[i]: the hash of the i-th charge's scope; KEYS[n + 1]: the reservation's marker (the
-- hash its settlement steps are recorded in). ARGV[1]: n; then, per charge, 6 values:
-- field (limit kind), interval (s/unit), tolerance (s), burst (units), cost (units), ttl (ms);
-- then the marker's life (ms); then k: the last k charges are optional, taken (all of them)
-- only if the others are and they have room too, never a refusal.
-- Returns {allowed (1/0), denied index (0 if allowed), now, retry_after, optional taken (1/0),
-- tat_1 .. tat_n}; an optional charge not taken leaves its bucket as it was.
-- A reservation that was voided (void.lua: its caller gave up waiting for this answer) is
-- refused without touching anything; one that is allowed marks itself reserved ('r'), so a
-- later void knows to give it back, and one whose optional charges were taken marks that ('o').
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[1])
local k = tonumber(ARGV[3 + n * 6] or '0')
local required = n - k
local marker = KEYS[n + 1]
local voided = redis.call('HEXISTS', marker, 'void') == 1
-- The i-th charge against ``held`` (the TATs it and the charges before it would leave):
-- its bucket's new TAT, or nil and how long until it fits (-1: never, it exceeds the burst).
local function charge(i, held)
  local b = 2 + (i - 1) * 6
  local id = KEYS[i] .. '|' .. ARGV[b]
  local tat = held[id]
  if tat == nil then tat = tonumber(redis.call('HGET', KEYS[i], ARGV[b]) or '0') end
  local interval, tol = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local burst, cost = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  if cost > burst then return nil, -1 end
  local new_tat = math.max(tat, now) + cost * interval
  if new_tat - tol > now then return nil, new_tat - tol - now end
  held[id] = new_tat
  return new_tat
end
local pending = {}
local denied, retry = 0, 0
if voided then denied, retry = 1, -1 end
for i = 1, required do
  if denied ~= 0 then break end
  local fits, wait = charge(i, pending)
  if not fits then denied, retry = i, wait end
end
local took = 0
if k > 0 and denied == 0 then
  took = 1
  local trial = {}
  for id, v in pairs(pending) do trial[id] = v end
  for i = required + 1, n do
    if not charge(i, trial) then
      took = 0
      break
    end
  end
  if took == 1 then pending = trial end
end
local out = {denied == 0 and 1 or 0, denied, string.format('%.6f', now),
             string.format('%.6f', retry), took}
if denied ~= 0 then
  for i = 1, n do
    local b = 2 + (i - 1) * 6
    local cur = redis.call('HGET', KEYS[i], ARGV[b]) or '0'
    out[#out + 1] = cur
  end
  return out
end
local last = took == 1 and n or required
for i = 1, last do
  local b = 2 + (i - 1) * 6
  local v = string.format('%.6f', pending[KEYS[i] .. '|' .. ARGV[b]])
  redis.call('HSET', KEYS[i], ARGV[b], v)
  local ttl = tonumber(ARGV[b + 5])
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
  out[#out + 1] = v
end
for i = last + 1, n do
  out[#out + 1] = redis.call('HGET', KEYS[i], ARGV[2 + (i - 1) * 6]) or '0'
end
redis.call('HSET', marker, 'r', '1')
if took == 1 then redis.call('HSET', marker, 'o', '1') end
redis.call('PEXPIRE', marker, ARGV[2 + n * 6])
return out
