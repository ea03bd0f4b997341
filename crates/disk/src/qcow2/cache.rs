//! A small least-recently-used cache of metadata tables, keyed by their
//! offset in the file.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

/// At most `capacity` tables; the least recently used one is evicted.
#[derive(Debug)]
pub struct TableCache<T> {
    capacity: usize,
    tick: u64,
    entries: HashMap<u64, (u64, T)>,
}

impl<T> TableCache<T> {
    /// An empty cache holding up to `capacity` (at least 1) tables.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            tick: 0,
            entries: HashMap::new(),
        }
    }

    /// The table at `offset`, marked recently used.
    pub fn get_mut(&mut self, offset: u64) -> Option<&mut T> {
        self.tick += 1;
        let tick = self.tick;
        self.entries.get_mut(&offset).map(|(used, table)| {
            *used = tick;
            table
        })
    }

    /// Adds the table at `offset`, evicting the least recently used one if
    /// the cache is full.
    pub fn insert(&mut self, offset: u64, table: T) -> &mut T {
        if !self.entries.contains_key(&offset) && self.entries.len() >= self.capacity {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(&k, _)| k);
            if let Some(oldest) = oldest {
                self.entries.remove(&oldest);
            }
        }
        self.tick += 1;
        let value = (self.tick, table);
        match self.entries.entry(offset) {
            Entry::Occupied(mut slot) => {
                slot.insert(value);
                &mut slot.into_mut().1
            }
            Entry::Vacant(slot) => &mut slot.insert(value).1,
        }
    }

    /// Number of cached tables.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cache_evicts_least_recently_used() {
        let mut cache = TableCache::new(2);
        cache.insert(1, "a");
        cache.insert(2, "b");
        assert!(cache.get_mut(1).is_some());
        cache.insert(3, "c");
        assert_eq!(cache.len(), 2);
        assert!(cache.get_mut(2).is_none());
        assert_eq!(cache.get_mut(1).copied(), Some("a"));
        assert_eq!(cache.get_mut(3).copied(), Some("c"));
    }

    #[test]
    fn test_cache_reinsert_replaces_without_eviction() {
        let mut cache = TableCache::new(2);
        cache.insert(1, 1);
        cache.insert(2, 2);
        cache.insert(2, 5);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get_mut(2).copied(), Some(5));
        assert_eq!(cache.get_mut(1).copied(), Some(1));
    }
}
