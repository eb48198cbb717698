//! The runtime's events (`error!`, `warn!`, `debug!`): what goes wrong where no `Result` can say
//! so (a free in a `Drop`, a fallback taken), written as `tracing` events.
//!
//! With the `tracing` feature they are `tracing`'s own macros. Without it (the default) `tracing`
//! is not built at all, since its crates and its per-event callsites were a tenth of a
//! default build's compile time (issue 34): errors and warnings are written to stderr, one line
//! each (`gpu-pool error: MESSAGE field=value ...`), and `debug!` writes nothing.

#[cfg(feature = "tracing")]
pub(crate) use tracing::{debug, error, warn};

/// An error event: stderr without the `tracing` feature.
#[cfg(not(feature = "tracing"))]
macro_rules! error {
    ($($event:tt)+) => { $crate::base::event::emit!("error" [] $($event)+) };
}

/// A warning event: stderr without the `tracing` feature.
#[cfg(not(feature = "tracing"))]
macro_rules! warning {
    ($($event:tt)+) => { $crate::base::event::emit!("warning" [] $($event)+) };
}

/// A debug event: nothing without the `tracing` feature (its fields are still type-checked, and
/// not evaluated).
#[cfg(not(feature = "tracing"))]
macro_rules! debug {
    ($($event:tt)+) => {
        if false {
            $crate::base::event::emit!("debug" [] $($event)+)
        }
    };
}

/// Writes one event to stderr. Takes `tracing`'s syntax for the fields the runtime uses
/// (`name = %display`, `name = ?debug`, `name = value`, `name`), then the message and its format
/// arguments; a value without `%` is written with `Debug`, as `tracing` records it.
#[cfg(not(feature = "tracing"))]
macro_rules! emit {
    ($level:literal [$($done:tt)*] $name:ident = % $value:expr, $($rest:tt)+) => {
        $crate::base::event::emit!($level [$($done)* $name ($value);] $($rest)+)
    };
    ($level:literal [$($done:tt)*] $name:ident = ? $value:expr, $($rest:tt)+) => {
        $crate::base::event::emit!($level [$($done)* $name (::std::format_args!("{:?}", $value));] $($rest)+)
    };
    ($level:literal [$($done:tt)*] $name:ident = $value:expr, $($rest:tt)+) => {
        $crate::base::event::emit!($level [$($done)* $name (::std::format_args!("{:?}", $value));] $($rest)+)
    };
    ($level:literal [$($done:tt)*] $name:ident, $($rest:tt)+) => {
        $crate::base::event::emit!($level [$($done)* $name (::std::format_args!("{:?}", $name));] $($rest)+)
    };
    ($level:literal [$($name:ident ($value:expr);)*] $message:literal $(, $arg:expr)* $(,)?) => {
        $crate::base::event::write(::std::format_args!(
            ::std::concat!("gpu-pool {}: {}", $(" ", ::std::stringify!($name), "={}",)*),
            $level,
            ::std::format_args!($message $(, $arg)*)
            $(, $value)*
        ))
    };
}

/// Writes an event's line to stderr (in this crate's unit tests, to the thread's `tests::LINES`).
#[cfg(not(feature = "tracing"))]
pub(crate) fn write(line: std::fmt::Arguments<'_>) {
    #[cfg(test)]
    tests::LINES.with_borrow_mut(|lines| lines.push(line.to_string()));
    // A closed stderr (`prog 2>&1 | head`) loses the line: most events come from a `Drop`, where
    // a panic would abort an unwinding thread.
    #[cfg(not(test))]
    {
        use std::io::Write;
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }
}

// After the definitions: a `macro_rules!` is in scope only below it. `warning` is exported as
// `warn`: a macro named `warn` would be ambiguous with the built-in attribute.
#[cfg(not(feature = "tracing"))]
pub(crate) use {debug, emit, error, warning as warn};

#[cfg(all(test, not(feature = "tracing")))]
mod tests {
    use std::cell::RefCell;

    thread_local! {
        /// The lines this thread's events wrote.
        pub(super) static LINES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    }

    fn lines() -> Vec<String> {
        LINES.take()
    }

    #[test]
    fn an_event_is_one_line_with_its_message_then_its_fields() {
        let bytes = 4096_usize;
        let e = "out of memory";
        let error = "a LIFO violation";
        super::error!(stream = 3_u64, error = %e, bytes, "freeing {} failed", "the stack");
        super::warn!(device = ?Some(1), "{error} (logged once)");
        super::debug!(stream = 3_u64, "not written");
        assert_eq!(
            lines(),
            [
                "gpu-pool error: freeing the stack failed stream=3 error=out of memory bytes=4096",
                "gpu-pool warning: a LIFO violation (logged once) device=Some(1)",
            ]
        );
    }

    #[test]
    fn a_debug_event_does_not_evaluate_its_fields() {
        let evaluated = std::cell::Cell::new(false);
        super::debug!(value = evaluated.set(true), "never");
        assert!(!evaluated.get());
        assert!(lines().is_empty());
    }
}
