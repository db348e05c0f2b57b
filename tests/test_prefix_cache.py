"""The prefix cache without a model: the hash chain and salt, lookup, LRU eviction, reference counts."""

import pytest

from jaxserve.scheduling.pages import PageAllocator
from jaxserve.scheduling.prefix_cache import extend_page_keys, page_key, PrefixCache

TOKENS = list(range(100, 120))  # 5 full pages of 4


def keys_of(tokens, extra=(), page_size=4):
    return extend_page_keys([], tokens, page_size, len(tokens) // page_size, extra)


# ---- hash chain and salt -------------------------------------------------------------------------------

def test_key_is_sha256_of_parent_tokens_and_extras():
    k = page_key(None, [1, 2, 3, 4])
    assert isinstance(k, bytes) and len(k) == 32
    assert page_key(None, [1, 2, 3, 4]) == k  # deterministic (no per-process hash seed)
    assert page_key(None, [1, 2, 3, 5]) != k
    assert page_key(None, [1, 2, 4, 3]) != k  # order matters
    assert page_key(k, [1, 2, 3, 4]) != k  # the parent is part of the key
    assert page_key(None, [1, 2, 3, 4], ("salt", "a")) != k
    assert page_key(None, [1, 2, 3, 4], ("salt", "a")) != page_key(None, [1, 2, 3, 4], ("salt", "b"))


def test_chain_names_the_whole_prefix():
    keys = keys_of(TOKENS)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert keys[2] == page_key(page_key(page_key(None, TOKENS[0:4]), TOKENS[4:8]), TOKENS[8:12])
    # Same page content after a different earlier page: a different key (its K/V differs too).
    other = keys_of([7, 7, 7, 7] + TOKENS[4:])
    assert other[0] != keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))
    # A longer sequence with the same start extends the same chain.
    assert keys_of(TOKENS + [1, 2, 3, 4, 5])[:5] == keys


def test_only_full_pages_get_keys_and_extension_is_incremental():
    keys = extend_page_keys([], TOKENS[:10], 4, 99)
    assert len(keys) == 2  # 10 tokens: 2 full pages, the partial third has no key
    same = extend_page_keys(keys, TOKENS, 4, 4)
    assert same is keys and keys == keys_of(TOKENS)[:4]


def test_salt_changes_every_key_of_the_chain():
    plain, salted_a, salted_b = keys_of(TOKENS), keys_of(TOKENS, ("salt", "a")), keys_of(TOKENS, ("salt", "b"))
    assert set(plain).isdisjoint(salted_a) and set(salted_a).isdisjoint(salted_b)
    assert keys_of(TOKENS, ("salt", "a")) == salted_a
    cache = PrefixCache()
    for page, key in enumerate(salted_a, start=1):
        cache.register(page, key)
    assert cache.lookup(salted_a) == [1, 2, 3, 4, 5]
    assert cache.lookup(salted_b) == [] and cache.lookup(plain) == []


def test_lookup_stops_at_first_miss_and_register_keeps_the_first_copy():
    keys = keys_of(TOKENS)
    cache = PrefixCache()
    cache.register(11, keys[0])
    cache.register(12, keys[1])
    cache.register(14, keys[3])  # page 3's key is missing, so 4 is unreachable
    assert cache.lookup(keys) == [11, 12]
    assert not cache.register(99, keys[0])  # a second copy of a cached prefix is not registered
    assert not cache.register(11, keys[4])  # nor is a page registered twice
    assert cache.lookup(keys[:1]) == [11] and not cache.holds(99)


# ---- allocator: reference counts and LRU eviction ------------------------------------------------------

def make_allocator(num_pages=6):
    cache = PrefixCache()
    return PageAllocator(num_pages, cache), cache


def test_page_in_use_is_never_evicted():
    alloc, cache = make_allocator(4)  # 3 usable pages
    keys = keys_of(TOKENS)
    a = alloc.allocate(3)
    for page, key in zip(a, keys):
        cache.register(page, key)
    assert alloc.num_free == 0 and alloc.allocate(1) is None  # cached but busy: not evictable
    alloc.acquire([a[0]])  # a second request shares the first page
    assert alloc.refcount(a[0]) == 2
    alloc.free(a)  # the first request ends
    assert alloc.refcount(a[0]) == 1 and cache.num_idle == 2 and alloc.num_free == 2
    taken = alloc.allocate(2)
    assert sorted(taken) == sorted(a[1:])  # only the idle pages were evicted
    assert alloc.allocate(1) is None  # a[0] is still in use
    assert cache.lookup(keys) == [a[0]]  # and still cached
    alloc.free(taken)
    alloc.free([a[0]])
    assert alloc.num_in_use == 0 and alloc.num_free == 3


def test_eviction_is_least_recently_used_after_plain_free_pages():
    alloc, cache = make_allocator(6)  # 5 usable
    keys = keys_of(TOKENS)
    pages = [alloc.allocate(1)[0] for _ in range(3)]
    for page, key in zip(pages, keys):
        cache.register(page, key)
    # Released in the order 1, 0, 2: that is their LRU order.
    for i in (1, 0, 2):
        alloc.free([pages[i]])
    assert cache.num_idle == 3 and alloc.num_free == 5
    # Never-cached pages go first: a cached page may still save someone a prefill.
    plain = alloc.allocate(2)
    assert not set(plain) & set(pages) and cache.num_cached == 3
    assert alloc.allocate(1) == [pages[1]] and cache.lookup(keys[1:2]) == []
    # A hit makes a page recently used: re-using page 0 and letting go moves it behind page 2.
    alloc.acquire([pages[0]])
    alloc.free([pages[0]])
    assert alloc.allocate(1) == [pages[2]]
    assert alloc.allocate(1) == [pages[0]]
    assert alloc.allocate(1) is None and cache.num_cached == 0


def test_releasing_a_sequence_evicts_its_tail_first():
    alloc, cache = make_allocator(6)
    seq = alloc.allocate(4)
    for page, key in zip(seq, keys_of(TOKENS)):
        cache.register(page, key)
    alloc.free(seq)
    # The last page of a sequence is the least likely to be shared: it is evicted first.
    assert [alloc.allocate(1)[0] for _ in range(5)][1:] == [seq[3], seq[2], seq[1], seq[0]]


def test_evict_cached_returns_every_idle_page_and_spares_busy_ones():
    alloc, cache = make_allocator(6)
    keys = keys_of(TOKENS)
    a = alloc.allocate(3)
    for page, key in zip(a, keys):
        cache.register(page, key)
    alloc.free(a[1:])
    assert alloc.evict_cached() == 2
    assert cache.num_cached == 1 and cache.lookup(keys) == [a[0]]
    alloc.free(a[:1])
    assert alloc.evict_cached() == 1 and cache.num_cached == 0 and alloc.num_free == alloc.num_usable


def test_double_free_and_null_page_are_errors():
    alloc, _ = make_allocator(4)
    a = alloc.allocate(1)
    alloc.free(a)
    with pytest.raises(ValueError, match="more often"):
        alloc.free(a)
    b = alloc.allocate(1)
    with pytest.raises(ValueError, match="more often"):
        alloc.free(b + b)  # validated before anything changes
    assert alloc.refcount(b[0]) == 1
    with pytest.raises(ValueError, match="null page"):
        alloc.free([0])


def test_allocator_without_cache_frees_pages_immediately():
    alloc = PageAllocator(4)
    a = alloc.allocate(3)
    assert alloc.allocate(1) is None
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.evict_cached() == 0
