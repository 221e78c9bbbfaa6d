-- kvgate lease renewal: the arithmetic of admission/state/lease.py, atomically in Redis.
-- KEYS[1]: the process heartbeat zset; KEYS[2..]: one lease hash per resource.
-- ARGV[1]: holder; ARGV[2]: TTL in ms; then (total, want, used) per resource.
-- A lease record is "granted want used expires_ms"; time is the Redis server's, so the
-- hosts' clocks do not matter. Returns {processes, granted, holders, others_used, rate,
-- ..., known}: known is 1 when the holder's heartbeat from its last renewal was still
-- there (0 on its first, or after this Redis lost it: a restart, a failover).
local holder = ARGV[1]
local ttl = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local exp = now + ttl
local before = tonumber(redis.call('ZSCORE', KEYS[1], holder))
local known = 0
if before ~= nil and before > now then known = 1 end
redis.call('ZADD', KEYS[1], exp, holder)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 2)
local out = {redis.call('ZCARD', KEYS[1])}
for i = 2, #KEYS do
  local base = 3 + (i - 2) * 3  -- arguments: three per resource
  local total = math.max(0, tonumber(ARGV[base]))
  local want = math.max(0, tonumber(ARGV[base + 1]))
  local used = math.max(0, tonumber(ARGV[base + 2]))
  local flat = redis.call('HGETALL', KEYS[i])
  local n, held, used_sum = 1, 0, 0
  local mine = redis.call('HGET', KEYS[i], holder)
  local prev = 0
  if mine then
    local g0, _, _, e0 = string.match(mine, '^(%d+) (%d+) (%d+) (%d+)$')
    if e0 ~= nil and tonumber(e0) > now then prev = tonumber(g0) end
  end
  local wants = {{want, holder, math.max(prev, used)}}
  for j = 1, #flat, 2 do
    local h = flat[j]
    local g, w, u, e = string.match(flat[j + 1], '^(%d+) (%d+) (%d+) (%d+)$')
    e = tonumber(e)
    if e == nil or e <= now then
      redis.call('HDEL', KEYS[i], h)
    elseif h ~= holder then
      g, w, u = tonumber(g), tonumber(w), tonumber(u)
      n = n + 1
      held = held + math.max(g, u)
      used_sum = used_sum + u
      wants[#wants + 1] = {math.max(w, u), h, math.max(g, u)}
    end
  end
  -- max-min fair (water-filling) in order of want, then of what each holds (most
  -- first: the rounding gives the larger parts to those holding least), then name
  table.sort(wants, function(x, y)
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[3] ~= y[3] then return x[3] > y[3] end
    return x[2] < y[2]
  end)
  local remaining, entitled = total, 0
  for k = 1, n do
    local share = math.min(wants[k][1], math.floor(remaining / (n - k + 1)))
    remaining = remaining - share
    if wants[k][2] == holder then
      entitled = share
    end
  end
  entitled = entitled + math.floor(remaining / n)  -- what nobody wants, split equally
  local granted = math.max(0, math.min(entitled, total - held))
  -- the refill rate of a rate-limited holder: its entitlement or its use, if larger
  local rate = math.max(0, math.min(math.max(entitled, used), total - held))
  redis.call('HSET', KEYS[i], holder, string.format('%d %d %d %d', granted, want, used, exp))
  redis.call('PEXPIRE', KEYS[i], ttl * 2)
  out[#out + 1] = granted
  out[#out + 1] = n
  out[#out + 1] = used_sum
  out[#out + 1] = rate
end
out[#out + 1] = known
return out
