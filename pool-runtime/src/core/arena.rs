//! The stack arena: one device allocation cut into a device's stacks, and which of them streams
//! hold.
//!
//! A stack is handed to a stream whole and comes back whole; what happens inside it is the stream's
//! business (`stack.rs`). The device keeps its arena behind its lock, so claiming and returning
//! stacks take that lock, and nothing on the allocation hot path does.

use std::sync::Arc;

use crate::base::error::PoolError;
use crate::core::config::PoolConfig;
use crate::core::stack::Stack;
use crate::storage::Storage;
use crate::storage::backend::{DevPtr, RawEvent};

/// Where a device's stack memory comes from when not from `cuMemAlloc`: an allocator whose memory a
/// library can do more with (NCCL's `ncclMemAlloc`, which NCCL can register for zero-copy
/// collectives). Its calls are counted as the device's driver calls. The seam a feature uses:
/// `Device::set_stack_source` chooses it, `Device::pin_stacks` keeps its memory while a library
/// has it registered.
pub(crate) trait StackMemory: Send + Sync {
    /// `bytes` of device memory on the arena's device.
    fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError>;

    /// Frees what [`alloc`](Self::alloc) returned.
    ///
    /// # Safety
    /// `ptr` came from this allocator's `alloc`, is freed once, and no work uses it any more.
    unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError>;
}

/// Every stack of a device, in one allocation.
pub(crate) struct Arena {
    base: DevPtr,
    /// The allocator the memory came from, if not the driver's; it frees it too.
    memory: Option<Arc<dyn StackMemory>>,
    /// Registrations with a library (NCCL) that must be undone before the memory goes.
    pins: usize,
    config: PoolConfig,
    held: Vec<bool>,
    /// Work of the stack's last stream that nobody could wait for when it let the stack go (it
    /// was dropped on a thread capturing a graph): the next stream to take it waits for this.
    after: Vec<Option<RawEvent>>,
}

impl Arena {
    /// Allocates the memory of `config`'s stacks, none of them held, from `memory` or else the
    /// driver.
    pub(crate) fn allocate(
        storage: &Storage,
        config: PoolConfig,
        memory: Option<Arc<dyn StackMemory>>,
    ) -> Result<Arena, PoolError> {
        let base = match &memory {
            Some(m) => {
                storage.count_alloc(None);
                m.alloc(config.total_bytes())?
            }
            None => storage.alloc(config.total_bytes(), None)?,
        };
        Ok(Arena {
            base,
            memory,
            pins: 0,
            config,
            held: vec![false; config.stack_count()],
            after: (0..config.stack_count()).map(|_| None).collect(),
        })
    }

    /// The config the arena was allocated with.
    pub(crate) fn config(&self) -> PoolConfig {
        self.config
    }

    /// The memory of every stack: its first address and its bytes.
    pub(crate) fn range(&self) -> (DevPtr, usize) {
        (self.base, self.config.total_bytes())
    }

    /// Whether the memory came from `memory` (the same allocator, not merely the same kind).
    pub(crate) fn is_from(&self, memory: Option<&Arc<dyn StackMemory>>) -> bool {
        match (&self.memory, memory) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        }
    }

    /// Counts a registration that must be undone before the memory is freed.
    pub(crate) fn pin(&mut self) {
        self.pins += 1;
    }

    /// Undoes one [`pin`](Self::pin).
    pub(crate) fn unpin(&mut self) {
        self.pins = self.pins.saturating_sub(1);
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
        if arena.pins > 0 {
            return Err(PoolError::StackMemoryRegistered { device: storage.id });
        }
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
        unsafe { arena.free_memory(storage) }?;
        let bytes = arena.config.total_bytes();
        *slot = None;
        Ok(bytes)
    }

    /// Frees the memory when its device goes: the last handle is gone, and streams hold one, so no
    /// stream uses the stacks.
    pub(crate) fn free_at_exit(self, storage: &Storage) {
        let freed = match &self.memory {
            // SAFETY: as above: no stream is left to use a stack, and `self` is consumed. A
            // registration holds the device, so none is left either.
            Some(m) => unsafe { m.free(self.base) },
            // SAFETY: as above.
            None => unsafe { storage.backend.free(self.base) },
        };
        if let Err(e) = freed {
            crate::base::event::error!(device = %storage.id, error = %e, "freeing the stack memory failed");
        }
    }

    /// Frees the memory through whoever allocated it, counted.
    ///
    /// # Safety
    /// No stream holds a stack, no work uses the memory, and the arena is dropped right after.
    unsafe fn free_memory(&self, storage: &Storage) -> Result<(), PoolError> {
        match &self.memory {
            Some(m) => {
                storage.count_free(None);
                // SAFETY: forwarded to the caller; `base` came from `m.alloc`.
                unsafe { m.free(self.base) }
            }
            // SAFETY: forwarded to the caller; `base` came from `storage.alloc`.
            None => unsafe { storage.free(self.base, None) },
        }
    }
}
