//! One process per rank on one host, as torchrun does it: a launcher starts its own executable
//! once per rank with `RANK`, `WORLD_SIZE` and the path of the file through which rank 0 hands
//! the NCCL unique id to the others. Shared by the `ranks` example and the tests of this plumbing
//! (`tests/pool/ranks.rs`, which need no GPU).
#![allow(
    dead_code,
    unreachable_pub,
    reason = "the example and the tests use different parts"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_pool::PoolError;
use gpu_pool::nccl::NcclError;
use gpu_pool::nccl::UniqueId;

/// The rank of this process (torchrun's name).
pub const RANK: &str = "RANK";
/// How many ranks (torchrun's name).
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// The file rank 0 writes the id to and the others read it from. Only with it set is a process a
/// rank: `RANK` alone (left over in a shell) does not make it one.
pub const ID_FILE: &str = "GPU_POOL_NCCL_ID_FILE";

/// What a rank process was started with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank.
    pub rank: usize,
    /// Ranks in all.
    pub world: usize,
    /// Where the id is handed over.
    pub id_file: PathBuf,
}

impl RankEnv {
    /// The rank this process was started as, `Ok(None)` for the launcher (no `ID_FILE`), and an
    /// error naming the variable for a rank, a world size or a pair of them that cannot be.
    pub fn from_env() -> Result<Option<RankEnv>, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), from `var` (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<RankEnv>, String> {
        let Some(id_file) = var(ID_FILE) else {
            return Ok(None);
        };
        let number = |name: &str| -> Result<usize, String> {
            let text = var(name).ok_or(format!("{ID_FILE} is set but {name} is not"))?;
            text.trim()
                .parse()
                .map_err(|e| format!("{name}={text:?} is not a number: {e}"))
        };
        let (rank, world) = (number(RANK)?, number(WORLD_SIZE)?);
        if world == 0 || rank >= world {
            return Err(format!(
                "{RANK}={rank} and {WORLD_SIZE}={world}: a rank is below the world size, which is 1 or more"
            ));
        }
        Ok(Some(RankEnv {
            rank,
            world,
            id_file: id_file.into(),
        }))
    }
}

/// Rank 0's part: writes `id`'s text to `path` at once (a file written aside, then renamed), so a
/// rank never reads half of it. The file is made new (an old one of that name is an error, not
/// overwritten) and readable by this user only: anyone who reads the id can join the
/// communicator.
pub fn publish_id(path: &Path, id: &UniqueId) -> std::io::Result<()> {
    use std::io::Write;
    let aside = path.with_extension(format!("part{}", std::process::id()));
    let mut open = std::fs::OpenOptions::new();
    open.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let mut file = open.open(&aside)?;
    file.write_all(format!("{id}\n").as_bytes())?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&aside, path)
}

/// The other ranks' part: waits for `path` to appear (up to `timeout`) and reads the id from it.
/// Errors: `NcclError::Timeout` if it never appears, `NcclId` for text that is no id.
pub fn read_id(path: &Path, timeout: Duration) -> Result<UniqueId, PoolError> {
    let start = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => return text.parse(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(PoolError::Nccl(NcclError::Id {
                    problem: format!("reading {}: {e}", path.display()),
                }));
            }
        }
        if start.elapsed() >= timeout {
            return Err(PoolError::Nccl(NcclError::Timeout {
                what: "waiting for rank 0's unique id file",
                waited: start.elapsed(),
            }));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What one rank process did.
#[derive(Debug)]
pub struct RankRun {
    /// Its rank.
    pub rank: usize,
    /// Whether it exited with 0.
    pub ok: bool,
    /// Its exit status, in words.
    pub status: String,
    /// What it printed (stdout, then stderr).
    pub output: String,
}

/// A fresh path for the id file of one launch, in a new directory only this user can enter
/// (made here, never one that existed: an old run's id, or another user's file, is never read);
/// the file itself is not made. [`remove_id_file`] removes both.
pub fn fresh_id_file() -> std::io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("gpu-pool-nccl-{}-{nanos}", std::process::id()));
    let mut make = std::fs::DirBuilder::new();
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut make, 0o700);
    make.create(&dir)?;
    Ok(dir.join("id"))
}

/// Removes the id file of [`fresh_id_file`] and its directory, whatever is left of them.
pub fn remove_id_file(path: &Path) {
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// How long the other ranks may still run after one failed, to print their own error, before
/// they are killed (they would otherwise wait for it until their NCCL timeout).
pub const SIBLING_GRACE: Duration = Duration::from_secs(3);

/// Starts this executable once per rank, with `args` and the rank's variables, and waits for
/// every one, killing those still running after `deadline` (a rank that hangs would otherwise
/// hang its launcher), and the others [`SIBLING_GRACE`] after one failed; the id file is removed
/// afterwards. If a rank cannot be started, those started are killed and waited for. Ranks run
/// side by side (NCCL needs them all at once), each printing into its own pipes, which threads
/// drain (a rank blocked on a full pipe while its peer waits for it in NCCL would hang both).
pub fn launch(world: usize, args: &[&str], deadline: Duration) -> std::io::Result<Vec<RankRun>> {
    let exe = std::env::current_exe()?;
    let id_file = fresh_id_file()?;
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        let started = Command::new(&exe)
            .args(args)
            .env(RANK, rank.to_string())
            .env(WORLD_SIZE, world.to_string())
            .env(ID_FILE, &id_file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match started {
            Ok(child) => children.push(child),
            Err(e) => {
                // The ranks started would wait for this one until their timeout.
                for mut child in children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                remove_id_file(&id_file);
                return Err(e);
            }
        }
    }
    let start = Instant::now();
    let first_failure = std::sync::OnceLock::<(usize, Instant)>::new();
    let first_failure = &first_failure;
    let runs = std::thread::scope(|scope| {
        let waits: Vec<_> = children
            .into_iter()
            .enumerate()
            .map(|(rank, mut child)| {
                let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
                    scope.spawn(move || {
                        let mut text = Vec::new();
                        if let Some(mut pipe) = pipe {
                            let _ = pipe.read_to_end(&mut text);
                        }
                        String::from_utf8_lossy(&text).into_owned()
                    })
                };
                let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
                let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
                scope.spawn(move || -> std::io::Result<_> {
                    let status = loop {
                        if let Some(status) = child.try_wait()? {
                            if !status.success() {
                                let _ = first_failure.set((rank, Instant::now()));
                            }
                            break (status.success(), status.to_string());
                        }
                        if start.elapsed() >= deadline {
                            child.kill()?;
                            child.wait()?;
                            let _ = first_failure.set((rank, Instant::now()));
                            break (false, format!("killed: still running after {deadline:?}"));
                        }
                        if let Some((failed, at)) = first_failure.get()
                            && at.elapsed() >= SIBLING_GRACE
                        {
                            child.kill()?;
                            child.wait()?;
                            break (
                                false,
                                format!(
                                    "killed: still running {SIBLING_GRACE:?} after rank \
                                     {failed} failed"
                                ),
                            );
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    };
                    let output = format!(
                        "{}{}",
                        out.join().unwrap_or_default(),
                        err.join().unwrap_or_default()
                    );
                    Ok((status, output))
                })
            })
            .collect();
        waits
            .into_iter()
            .enumerate()
            .map(|(rank, wait)| {
                let ((ok, status), output) =
                    wait.join().expect("a rank's waiting thread panicked")?;
                Ok(RankRun {
                    rank,
                    ok,
                    status,
                    output,
                })
            })
            .collect()
    });
    remove_id_file(&id_file);
    runs
}
