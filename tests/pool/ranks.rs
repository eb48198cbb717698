//! NCCL ranks in processes of their own, what needs no GPU: the unique id as bytes and text, the
//! refusals made before NCCL, and the example's launch plumbing (this binary started once per
//! rank, rank 0's id handed to the others through a file).

use std::collections::HashMap;
use std::error::Error;
use std::time::Duration;

use gpu_pool::nccl::NcclError;
use gpu_pool::nccl::{Communicators, UniqueId};
use gpu_pool::prelude::*;

/// The launch plumbing of the `ranks` example (the GPU suite starts its rank processes with it
/// too).
#[path = "../../examples/support/ranks.rs"]
pub(crate) mod ranks_support;

use ranks_support::{ID_FILE, RANK, RankEnv, WORLD_SIZE, launch, publish_id, read_id};

type TestResult = Result<(), Box<dyn Error>>;

#[test]
fn a_unique_id_goes_through_bytes_and_text_and_other_text_is_refused() -> TestResult {
    let bytes: [u8; 128] = std::array::from_fn(|i| (i * 37 + 11) as u8);
    let id = UniqueId::from_bytes(bytes);
    assert_eq!(id.to_bytes(), bytes);
    let text = id.to_string();
    assert_eq!(text.len(), 256);
    assert!(
        text.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(text.parse::<UniqueId>()?, id);
    assert_eq!(
        format!("{text}\n").parse::<UniqueId>()?,
        id,
        "a line's end is fine"
    );
    assert_eq!(text.to_uppercase().parse::<UniqueId>()?, id);
    let refused = [
        String::new(),
        text[..254].to_string(),
        format!("{text}00"),
        format!("zz{}", &text[2..]),
        format!("+f{}", &text[2..]), // u8::from_str_radix would take "+f"
        format!("é{}", &text[3..]),  // 256 bytes, not 256 digits
    ];
    for bad in &refused {
        let e = bad.parse::<UniqueId>().expect_err(bad);
        assert!(matches!(e, PoolError::Nccl(NcclError::Id { .. })), "{e:?}");
        assert!(e.to_string().contains("256 hex digits"), "{e}");
    }
    println!(
        "nccl_id: 128 bytes <-> 256 hex digits; {} malformed texts refused",
        refused.len()
    );
    Ok(())
}

#[test]
fn a_rank_outside_its_world_is_refused_before_nccl_or_the_device_is_asked() -> TestResult {
    let stream = Stream::new(&Device::private_host())?;
    let id = UniqueId::from_bytes([1; 128]);
    let t = Duration::from_secs(1);
    for (rank, world) in [(2, 2), (0, 0), (5, 3), (0, i32::MAX as usize + 1)] {
        let made = Communicators::from_rank(&stream, &id, rank, world, t);
        assert!(
            matches!(made, Err(PoolError::Nccl(NcclError::Rank { rank: r, world: w })) if r == rank && w == world),
            "{made:?}"
        );
    }
    // A good rank on a host stream: refused as a host stream, before NCCL is loaded.
    let host = Communicators::from_rank(&stream, &id, 0, 2, t);
    assert!(
        matches!(host, Err(PoolError::Unsupported { .. })),
        "{host:?}"
    );
    println!(
        "nccl_rank_refusals: rank >= world, world 0, world past i32 and a host stream refused"
    );
    Ok(())
}

#[test]
fn a_rank_process_reads_its_variables_and_refuses_impossible_ones() {
    let vars = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankEnv::from_vars(move |name| map.get(name).cloned())
    };
    assert_eq!(
        vars(&[(RANK, "1"), (WORLD_SIZE, "2")]),
        Ok(None),
        "no id file: the launcher"
    );
    assert_eq!(
        vars(&[(RANK, "1"), (WORLD_SIZE, "2"), (ID_FILE, "/tmp/id")]),
        Ok(Some(RankEnv {
            rank: 1,
            world: 2,
            id_file: "/tmp/id".into()
        }))
    );
    for bad in [
        vec![(RANK, "2"), (WORLD_SIZE, "2"), (ID_FILE, "f")],
        vec![(RANK, "0"), (WORLD_SIZE, "0"), (ID_FILE, "f")],
        vec![(RANK, "one"), (WORLD_SIZE, "2"), (ID_FILE, "f")],
        vec![(WORLD_SIZE, "2"), (ID_FILE, "f")],
    ] {
        let read = vars(&bad);
        assert!(read.is_err(), "{bad:?}: {read:?}");
    }
}

#[test]
fn an_id_file_that_never_comes_or_holds_no_id_is_a_typed_error() -> TestResult {
    let path = ranks_support::fresh_id_file()?;
    let start = std::time::Instant::now();
    let never = read_id(&path, Duration::from_millis(50));
    assert!(
        matches!(never, Err(PoolError::Nccl(NcclError::Timeout { .. }))),
        "{never:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    std::fs::write(&path, "not an id\n")?;
    let garbage = read_id(&path, Duration::from_millis(50));
    assert!(
        matches!(garbage, Err(PoolError::Nccl(NcclError::Id { .. }))),
        "{garbage:?}"
    );
    std::fs::remove_file(&path)?;
    let id = UniqueId::from_bytes([0xa5; 128]);
    publish_id(&path, &id)?;
    assert_eq!(read_id(&path, Duration::from_millis(50))?, id);
    ranks_support::remove_id_file(&path);
    Ok(())
}

#[cfg(unix)]
#[test]
fn the_id_file_is_private_and_made_in_a_new_private_directory() -> TestResult {
    use std::os::unix::fs::PermissionsExt;
    let path = ranks_support::fresh_id_file()?;
    let dir = path.parent().ok_or("no directory")?.to_path_buf();
    let id = UniqueId::from_bytes([0x5a; 128]);
    publish_id(&path, &id)?;
    let modes = (
        std::fs::metadata(&dir)?.permissions().mode() & 0o777,
        std::fs::metadata(&path)?.permissions().mode() & 0o777,
    );
    println!("nccl_id_file: directory {:o}, file {:o}", modes.0, modes.1);
    assert_eq!(modes, (0o700, 0o600));
    // A leftover aside file of this process is not overwritten: creating the id fails instead.
    std::fs::remove_file(&path)?;
    let aside = path.with_extension(format!("part{}", std::process::id()));
    std::fs::write(&aside, "someone else's\n")?;
    assert!(publish_id(&path, &id).is_err());
    ranks_support::remove_id_file(&path);
    assert!(!dir.exists(), "the directory goes with the file");
    Ok(())
}

/// A rank process of the test below that fails at once (rank 0) or would sleep for a minute
/// (the others); nothing in an ordinary run.
#[test]
fn failing_rank_process() -> TestResult {
    let Some(env) = RankEnv::from_env()? else {
        return Ok(());
    };
    if env.rank == 0 {
        return Err("rank 0 fails on purpose".into());
    }
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

#[test]
fn when_one_rank_fails_the_launcher_kills_the_others_soon_after() -> TestResult {
    if RankEnv::from_env()?.is_some() {
        return Ok(());
    }
    let args = [
        "ranks::failing_rank_process",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ];
    let start = std::time::Instant::now();
    let runs = launch(2, &args, Duration::from_secs(120))?;
    let took = start.elapsed();
    for run in &runs {
        println!("failing_rank: rank {} {}", run.rank, run.status);
    }
    println!("failing_rank: the launch took {took:?}");
    assert!(!runs[0].ok && !runs[1].ok);
    assert!(
        runs[1].status.contains("after rank 0 failed"),
        "{}",
        runs[1].status
    );
    assert!(
        took < Duration::from_secs(30),
        "{took:?}: the sibling was waited for"
    );
    Ok(())
}

/// The body of each rank process of the test below (nothing in an ordinary run: only a process
/// started with the rank variables is a rank). Rank 0 makes an id (from its process id: no NCCL
/// here) and publishes it; the others read it.
#[test]
fn id_exchange_rank_process() -> TestResult {
    let Some(env) = RankEnv::from_env()? else {
        return Ok(());
    };
    let id = if env.rank == 0 {
        let seed = std::process::id().to_le_bytes();
        let id = UniqueId::from_bytes(std::array::from_fn(|i| seed[i % 4] ^ i as u8));
        publish_id(&env.id_file, &id)?;
        id
    } else {
        read_id(&env.id_file, Duration::from_secs(60))?
    };
    println!("rank {} of {}: id {id}", env.rank, env.world);
    Ok(())
}

#[test]
fn rank_0s_id_reaches_every_rank_process_through_a_file() -> TestResult {
    if RankEnv::from_env()?.is_some() {
        return Ok(()); // a rank process of the test above: no launching from there
    }
    let args = [
        "ranks::id_exchange_rank_process",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ];
    let runs = launch(3, &args, Duration::from_secs(120))?;
    let mut ids = Vec::new();
    for run in &runs {
        println!(
            "id_exchange: rank {} {}:\n{}",
            run.rank, run.status, run.output
        );
        assert!(run.ok, "rank {} failed: {}", run.rank, run.status);
        // libtest prints the test's name on the same line, before it.
        let said = format!("rank {} of 3: id ", run.rank);
        let text = run
            .output
            .lines()
            .find_map(|l| l.split_once(&said).map(|(_, id)| id))
            .ok_or("the rank printed no id")?;
        ids.push(text.parse::<UniqueId>()?);
    }
    assert_eq!(ids.len(), 3);
    assert!(
        ids.iter().all(|id| *id == ids[0]),
        "every rank has rank 0's id: {ids:?}"
    );
    println!("id_exchange: 3 processes, one id, handed over through a file");
    Ok(())
}
