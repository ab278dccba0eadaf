-- The TATs of one scope's buckets, at Redis server time, changing nothing.
-- KEYS[1]: the scope's hash; ARGV: the limit kinds. Returns {seconds, microseconds, tat...}
-- ('' for a bucket never used: full).
local t = redis.call('TIME')
local out = {t[1], t[2]}
for i = 1, #ARGV do
  out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i]) or ''
end
return out
