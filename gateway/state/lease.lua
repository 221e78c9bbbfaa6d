-- kvgate lease renewal: the arithmetic of admission/lease.py (grant), atomically in Redis.
-- KEYS[1]: the process heartbeat zset; KEYS[2..]: one lease hash per resource.
-- ARGV[1]: holder; ARGV[2]: TTL in ms; then (total, want, used, head, slack_ms) per
-- resource (slack_ms -1: the head has no deadline).
-- A lease record is "granted want used expires_ms"; a holder that names a head has a
-- second field, "^<holder>" = "size due_ms expires_ms" (an older script deletes it as
-- no record, and leases as before). Time is the Redis server's, so the hosts' clocks
-- do not matter. Returns {processes, granted, holders, others_used, rate,
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
local match, byte, sub = string.match, string.byte, string.sub
local floor, min, max = math.floor, math.min, math.max
local RECORD = '^(%d+) (%d+) (%d+) (%d+)$'
local HEAD = '^(%d+) (%d+) (%d+)$'
local HEAD_MARK = 94  -- '^': a head field's name is '^' .. holder
local NO_DUE = 9007199254740992  -- 2^53 ms: after every deadline
local my_head_field = '^' .. holder
-- Scratch tables, written from index 1 for each resource (not allocated per resource):
-- the holders' wants and names, the holds and names of those whose want equals
-- the holder's, and the heads named (size, due, holder).
local wants, names, tie_hold, tie_name = {}, {}, {}, {}
local head_size, head_due, head_name = {}, {}, {}

-- `_heads_first` of admission/lease.py: the heads of live holders are dealt whole by
-- (due, name) while each fits what is left, and the rest is water-filled over the wants
-- less the heads dealt, by (that, name). Holder 1 is this one. nil: no head fits.
local function heads_first(total, n, nh)
  local index = {}
  for k = 1, n do index[names[k]] = k end
  local order = {}
  for j = 1, nh do
    if head_size[j] > 0 and index[head_name[j]] then order[#order + 1] = j end
  end
  table.sort(order, function(a, b)
    if head_due[a] ~= head_due[b] then return head_due[a] < head_due[b] end
    return head_name[a] < head_name[b]
  end)
  local dealt, beyond, by = {}, {}, {}
  local rest, any = total, false
  for k = 1, n do dealt[k] = 0 end
  for _, j in ipairs(order) do
    if head_size[j] <= rest then
      local k = index[head_name[j]]
      dealt[k] = head_size[j]
      rest = rest - head_size[j]
      any = true
    end
  end
  if not any then return nil end
  for k = 1, n do
    beyond[k] = max(0, wants[k] - dealt[k])
    by[k] = k
  end
  table.sort(by, function(a, b)
    if beyond[a] ~= beyond[b] then return beyond[a] < beyond[b] end
    return names[a] < names[b]
  end)
  local mine = 0
  for i = 1, n do
    local k = by[i]
    local share = min(beyond[k], floor(rest / (n - i + 1)))
    rest = rest - share
    if k == 1 then mine = share end
  end
  return dealt[1] + mine + floor(rest / n)
end

for i = 2, #KEYS do
  local base = 3 + (i - 2) * 5  -- arguments: five per resource
  local total = max(0, tonumber(ARGV[base]))
  local want = max(0, tonumber(ARGV[base + 1]))
  local used = max(0, tonumber(ARGV[base + 2]))
  local my_head = max(0, tonumber(ARGV[base + 3]))
  local slack = tonumber(ARGV[base + 4])
  local flat = redis.call('HGETALL', KEYS[i])
  -- One pass over the records: the holder's own previous grant (its record is among
  -- them: no HGET of it), the others' wants and holds (each raised to its use), their
  -- sums, and the holds and names of those whose want equals this holder's (where it
  -- stands among them needs what it holds, known once its record was read).
  local n, held, used_sum, wanted, prev, ties, nh, had_head = 1, 0, 0, want, 0, 0, 0, false
  wants[1], names[1] = want, holder
  if my_head > 0 then
    nh = 1
    head_size[1], head_name[1] = my_head, holder
    head_due[1] = NO_DUE
    if slack >= 0 then head_due[1] = now + slack end
  end
  for j = 1, #flat, 2 do
    local h = flat[j]
    -- (x + 0 turns a string of digits into its number as tonumber(x) does, without the
    -- function call)
    if byte(h) == HEAD_MARK then
      local size, due, e = match(flat[j + 1], HEAD)
      if e == nil or e + 0 <= now then
        redis.call('HDEL', KEYS[i], h)
      elseif h == my_head_field then
        had_head = true  -- rewritten or deleted below
      else
        nh = nh + 1
        head_size[nh], head_due[nh], head_name[nh] = size + 0, due + 0, sub(h, 2)
      end
    else
      local g, w, u, e = match(flat[j + 1], RECORD)
      if e == nil or e + 0 <= now then
        redis.call('HDEL', KEYS[i], h)
      elseif h == holder then
        prev = g + 0
      else
        g, w, u = g + 0, w + 0, u + 0
        if u > w then w = u end
        if u > g then g = u end
        n = n + 1
        held = held + g
        used_sum = used_sum + u
        wanted = wanted + w
        wants[n], names[n] = w, h
        if w == want then
          ties = ties + 1
          tie_hold[ties] = g
          tie_name[ties] = h
        end
      end
    end
  end
  -- Max-min fair (water-filling): the n wants in order of want, then of what each holds
  -- (most first: the rounding gives the larger parts to those holding least), then name;
  -- the k-th is entitled to min(want_k, floor(remaining / (n - k + 1))), remaining being
  -- the total less the earlier ones' parts, and what remains after the n-th is split
  -- equally. This holder's entry is its want (not raised to its use, as the others' are).
  local entitled
  if wanted <= total then
    -- Every want fits: each is entitled to its want, whatever the order, so no sort.
    -- Ascending, before the k-th: remaining = total - (want_1 + ... + want_k-1) >=
    -- want_k + ... + want_n >= (n - k + 1) * want_k, so the floor is >= want_k (an
    -- integer) and the k-th's part is want_k; after the n-th, total - wanted remains.
    entitled = want + floor((total - wanted) / n)
  elseif nh > 0 then
    entitled = heads_first(total, n, nh)
  end
  if entitled == nil then
    -- Some part falls short of its want (all of them met would sum to wanted > total).
    -- Only the wants' values in order and this holder's position among them matter:
    -- after the smaller wants, and after the equal ones that hold more (or as much, with
    -- a smaller name). Nothing remains after the n-th: at the first part short of its
    -- want, remaining = m * q + r (m entries left, 0 <= r < m) and the part is q; every
    -- later want is >= q + 1 and every later floor q or q + 1, so the m parts are q, then
    -- q + 1 for the last r: remaining exactly.
    local mine = max(prev, used)
    local pos = 1
    for k = 2, n do
      if wants[k] < want then pos = pos + 1 end
    end
    for k = 1, ties do
      local g = tie_hold[k]
      if g > mine or (g == mine and tie_name[k] < holder) then pos = pos + 1 end
    end
    local sorted = {}
    for k = 1, n do sorted[k] = wants[k] end
    table.sort(sorted)  -- numbers: compared in C, no Lua comparator
    local remaining = total
    for k = 1, pos do
      local share = min(sorted[k], floor(remaining / (n - k + 1)))
      remaining = remaining - share
      entitled = share
    end
  end
  local granted = max(0, min(entitled, total - held))
  -- the refill rate of a rate-limited holder: its entitlement or its use, if larger
  local rate = max(0, min(max(entitled, used), total - held))
  redis.call('HSET', KEYS[i], holder, string.format('%d %d %d %d', granted, want, used, exp))
  if my_head > 0 then
    redis.call('HSET', KEYS[i], my_head_field, string.format('%d %d %d', my_head, head_due[1], exp))
  elseif had_head then
    redis.call('HDEL', KEYS[i], my_head_field)
  end
  redis.call('PEXPIRE', KEYS[i], ttl * 2)
  out[#out + 1] = granted
  out[#out + 1] = n
  out[#out + 1] = used_sum
  out[#out + 1] = rate
end
out[#out + 1] = known
return out
