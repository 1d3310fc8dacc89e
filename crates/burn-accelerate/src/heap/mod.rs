//! The process's memory below every layer: handing freed heap memory back to the system after a phase that
//! allocated large buffers one at a time, and telling an out-of-memory failure from every other one ([`oom`]).

pub mod oom;

/// [`release_free_heap`] after a value of `bytes` was freed, when it was large (at least 1 MiB): a phase that
/// allocates and frees one large buffer after another (parameters drawn or loaded one at a time) calls it after
/// each, so that freed memory is not kept resident beside the next one.
pub(crate) fn release_after_freeing(bytes: usize) {
    if bytes >= 1 << 20 {
        release_free_heap();
    }
}

/// Hands the process's free heap memory back to the system (glibc's `malloc_trim`; nothing elsewhere), after a
/// phase that allocated and freed large host buffers one at a time: `prepare_model` (the main process draws each
/// whole parameter), loading weights or a state. glibc raises its threshold for serving large allocations from
/// the heap each time one is freed, and keeps freed heap memory up to twice that: without this, a rank that drew
/// the model would hold on to about its largest tensor for the rest of the run, and the ranks' memory would differ.
pub(crate) fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns memory the allocator holds free; no pointer the program holds changes.
    unsafe {
        libc::malloc_trim(0);
    }
}
