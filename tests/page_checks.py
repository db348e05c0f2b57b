"""The leak check every workload ends with, now that the prefix cache keeps pages after requests end."""


def assert_pages_released(scheduler) -> None:
    """Every KV page is free or held only by the prefix cache (idle), every slot is free, and
    evicting the cache hands every page back as a plain free page."""
    allocator, cache = scheduler.allocator, scheduler.prefix_cache
    assert allocator.num_in_use == 0, f"{allocator.num_in_use} pages still held by requests"
    assert allocator.num_free == allocator.num_usable
    assert scheduler.num_free_slots == len(scheduler.slots) and not scheduler.waiting
    if cache is not None:
        assert cache.num_cached == cache.num_idle  # nothing cached is still in use
        idle = cache.num_idle
        assert scheduler.reset_prefix_cache() == idle and cache.num_cached == 0
    assert allocator.num_plain_free == allocator.num_usable
