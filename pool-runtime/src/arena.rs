//! The stack arena: one device allocation cut into a device's stacks, and which of them streams
//! hold.
//!
//! A stack is handed to a stream whole and comes back whole; what happens inside it is the stream's
//! business (`stack.rs`). The device keeps its arena behind its lock, so claiming and returning
//! stacks take that lock, and nothing on the allocation hot path does.

use crate::backend::{DevPtr, RawEvent};
use crate::config::PoolConfig;
use crate::error::PoolError;
use crate::stack::Stack;
use crate::storage::Storage;

/// Every stack of a device, in one allocation.
pub(crate) struct Arena {
    base: DevPtr,
    config: PoolConfig,
    held: Vec<bool>,
    /// Work of the stack's last stream that nobody could wait for when it let the stack go (it
    /// was dropped on a thread capturing a graph): the next stream to take it waits for this.
    after: Vec<Option<RawEvent>>,
}

impl Arena {
    /// Allocates the memory of `config`'s stacks, none of them held.
    pub(crate) fn allocate(storage: &Storage, config: PoolConfig) -> Result<Arena, PoolError> {
        let base = storage.alloc(config.total_bytes(), None)?;
        Ok(Arena {
            base,
            config,
            held: vec![false; config.stack_count()],
            after: (0..config.stack_count()).map(|_| None).collect(),
        })
    }

    /// The config the arena was allocated with.
    pub(crate) fn config(&self) -> PoolConfig {
        self.config
    }

    /// How many stacks streams hold.
    pub(crate) fn held_count(&self) -> usize {
        self.held.iter().filter(|h| **h).count()
    }

    /// Whether a stack is free.
    pub(crate) fn has_free(&self) -> bool {
        self.held_count() < self.held.len()
    }

    /// Hands out a free stack, whose blocks start on `align` (the texture alignment), with the
    /// event its last stream's work must be waited for at, if any. `None` when every stack is held.
    pub(crate) fn claim(&mut self, align: usize) -> Option<(Stack, Option<RawEvent>)> {
        let index = self.held.iter().position(|h| !h)?;
        self.held[index] = true;
        let size = self.config.stack_size();
        let stack = Stack::new(index, self.base + (index * size) as DevPtr, size, align);
        Some((stack, self.after[index].take()))
    }

    /// Takes stack `index` back. Its stream has synchronized, or passes the event that marks the
    /// end of its work, for the next stream to wait for.
    pub(crate) fn return_stack(&mut self, index: usize, after: Option<RawEvent>) {
        if index < self.held.len() {
            self.held[index] = false;
            self.after[index] = after;
        }
    }

    /// Frees the arena in `slot`, if no stack is held (else `PoolError::ConfigInUse`); returns the
    /// bytes freed. On an error the arena stays in the slot.
    pub(crate) fn free(slot: &mut Option<Arena>, storage: &Storage) -> Result<usize, PoolError> {
        let Some(arena) = slot.as_ref() else {
            return Ok(0);
        };
        let held = arena.held_count();
        if held > 0 {
            return Err(PoolError::ConfigInUse {
                device: storage.id,
                held,
            });
        }
        // A stack given back with an event (its stream was dropped where it could not wait): that
        // work may still use the memory, so it is waited for here, by polling (a rare path).
        for event in arena.after.iter().flatten() {
            while !storage.backend.event_done(event)? {
                std::thread::yield_now();
            }
        }
        // SAFETY: no stack is held, so no stream can hand out or use stack memory; streams
        // synchronize before giving their stack back, or give it back with an event waited for
        // just above, so no queued work uses it either. The arena leaves its slot once freed: the
        // address is freed once.
        unsafe { storage.free(arena.base, None) }?;
        let bytes = arena.config.total_bytes();
        *slot = None;
        Ok(bytes)
    }

    /// Frees the memory when its device goes: the last handle is gone, and streams hold one, so no
    /// stream uses the stacks.
    pub(crate) fn free_at_exit(self, storage: &Storage) {
        // SAFETY: as above: no stream is left to use a stack, and `self` is consumed.
        if let Err(e) = unsafe { storage.backend.free(self.base) } {
            tracing::error!(device = %storage.id, error = %e, "freeing the stack memory failed");
        }
    }
}
